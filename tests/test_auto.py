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


def _main_job_model():
    """The main job's model (recipes/train_gpt2.py build_model) and its per-step batch."""
    import os
    import sys

    import torch

    recipes = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    if recipes not in sys.path:
        sys.path.insert(0, recipes)
    from train_gpt2 import build_model

    ids = torch.zeros(8, 32, dtype=torch.long)
    return build_model(), {"input_ids": ids, "labels": ids}


def test_auto_plan_for_the_main_job_is_one_the_code_generator_accepts():
    """On these numbers the search used to pick a 2 x 2 mesh that split the cross-entropy along its
    batch and its class dims, which the code generator refuses; nns.plan lowers the plan, so every
    rank would have failed at launch."""
    model, batch = _main_job_model()
    spec = _spec(4)
    plan = nns.plan(model, strategy="auto", world_size=4, example_inputs=batch, cluster=spec)
    again = nns.simulate(plan, spec)
    assert again.step_time_s == pytest.approx(plan.options["estimated_step_s"], rel=1e-9)
    assert again.details["training"]["dtype"] == plan.precision == "fp32"


def test_auto_prices_the_precision_and_recompute_it_runs():
    import models
    from nnscaler_plugins.search import RecomputeModes

    model, inputs = models.gpt2_small()
    spec = _spec(2)
    plan = nns.plan(model, strategy="auto", world_size=2, example_inputs=inputs, cluster=spec, precision="bf16",
                    constraints=[RecomputeModes(["full"])])
    assert plan.precision == "bf16" and plan.knobs.recompute == "full"
    assert any(p.recompute is not None for p in plan.ops.values())  # the groups the runtime checkpoints
    est = nns.simulate(plan, spec)
    assert est.details["training"]["dtype"] == "bf16" and est.details["training"]["recompute"] == "full"
    assert est.step_time_s == pytest.approx(plan.options["estimated_step_s"], rel=1e-9)


def test_auto_sees_each_mixture_of_experts_layer_as_one_op():
    """`auto` captures a MoE layer as one op, so the search may split its experts (ep) or widths
    (etp) or keep it whole; its plan records that, so a run captures the same way."""
    import torch
    from test_expert_parallel import mixtral

    torch.manual_seed(0)
    model, batch = mixtral()
    plan = nns.plan(model, strategy="auto", world_size=2, example_inputs=batch)
    experts = [name for name in plan.ops if name.startswith("experts_call")]
    assert len(experts) == 2 and plan.knobs.experts_as_one_op is True, sorted(plan.ops)[:8]
