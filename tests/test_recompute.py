"""Activation recompute as a plan choice: same results, less kept for backward."""
from __future__ import annotations

import pytest
import torch

import models
import nnscaler_plugins as nns
from test_equivalence import run_case
from test_pipeline import run_pipeline_case


@pytest.mark.parametrize("name,strategy,recompute", [
    ("gpt2_small", "tp", "full"),
    ("llama_small", "tp", "selective"),
    ("llama_small", "dp", "LlamaMLP"),
])
def test_recompute_equivalence_2(workers2, name, strategy, recompute):
    problems = workers2.run(run_case, name, strategy, {"recompute": recompute})
    assert not any(problems), problems


def test_recompute_in_a_pipeline(workers2):
    results = workers2.run(run_pipeline_case, "gpt2_small", 2, "megatron",
                           {"pp": 2, "micro_batches": 2, "recompute": "full"}, 1)
    assert not [p for r in results for p in r[0]]


def saved_bytes(rank: int, world: int, name: str, options: dict) -> int:
    from nnscaler_plugins.kernels.coshard import measure_forward
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    model, inputs = getattr(models, name)()
    model.eval()
    pm = nns.parallelize(model, inputs, plan="tp", cache_dir="/tmp/nns_test_cache", **options)
    loss, saved = measure_forward(lambda: extract_loss(pm(**inputs)))
    loss.backward()
    return saved


def test_recompute_lowers_activation_memory(workers2):
    none = workers2.run(saved_bytes, "llama_small", {})
    selective = workers2.run(saved_bytes, "llama_small", {"recompute": "selective"})
    full = workers2.run(saved_bytes, "llama_small", {"recompute": "full"})
    for n, s, f in zip(none, selective, full):
        assert f < s < n, (n, s, f)
        assert f < 0.5 * n


def test_recompute_groups_in_the_plan():
    model, inputs = models.gpt2_small()
    graph = nns.capture(model, kwargs=inputs)
    plan = nns.plan(graph, strategy="tp", world_size=2, recompute="full")
    groups = {p.recompute for p in plan.ops.values() if p.recompute is not None}
    assert len(groups) == model.config.n_layer
    assert "recompute:" in plan.explain()
    with pytest.raises(nns.PlanError, match="matches no ops"):
        nns.plan(graph, strategy="tp", world_size=2, recompute="NoSuchModule")
