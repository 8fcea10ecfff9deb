"""strategy="auto": the plan the search picks for the local cluster trains exactly like one process.

Every rank runs the search itself (as `nns.parallelize(plan="auto")` would); the cluster spec is
made once here and handed to every rank, so all ranks search the same cluster and find the same
plan. The equivalence check is `run_case` of test_equivalence.py, the one every hand strategy passes.
"""
from __future__ import annotations

import pytest

from test_equivalence import run_case

import nnscaler_plugins as nns


def _spec(world: int):
    # measure=False: fixed, typical CPU numbers, so the test does not depend on how busy the machine is
    return nns.cluster("local-cpu", devices=world, measure=False)


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
def test_auto_equivalence_2(workers2, name):
    problems = workers2.run(run_case, name, "auto", {"cluster": _spec(2)})
    assert not any(problems), problems


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
def test_auto_equivalence_4(workers4, name):
    problems = workers4.run(run_case, name, "auto", {"cluster": _spec(4)})
    assert not any(problems), problems


def test_auto_plan_is_the_search_best():
    import models

    model, inputs = models.gpt2_small()
    spec = _spec(2)
    plan = nns.plan(model, strategy="auto", world_size=2, example_inputs=inputs, cluster=spec)
    assert plan.strategy == "auto"
    assert plan.options["estimated_step_s"] > 0
    graph = nns.capture(model, kwargs=inputs)
    again = nns.plan(graph, strategy="auto", world_size=2, cluster=spec)
    assert again.to_json()["ops"] == plan.to_json()["ops"]  # deterministic
