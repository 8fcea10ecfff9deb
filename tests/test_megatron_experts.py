"""The megatron strategy writes mixture-of-experts configurations down as published: ep= / etp= (and
capacity_factor=) split the experts as strategy "ep" does, on the experts' mesh; what it cannot combine
with them is refused by name before anything is captured twice."""
from __future__ import annotations

import pytest
import torch

from sgd_check import sgd_equivalence
from test_expert_parallel import MODELS, mixtral


@pytest.mark.parametrize("options,world", [({"ep": 2}, 2), ({"ep": 2, "pp": 2}, 4), ({"ep": 2, "dp": 2}, 4),
                                           ({"ep": 1, "etp": 2, "tp": 2}, 2), ({"ep": 2, "capacity_factor": 1.5}, 2)])
def test_megatron_with_experts_plans_what_strategy_ep_plans(options, world):
    import nnscaler_plugins as nns

    model, batch = mixtral()
    half = {k: v[:2] for k, v in batch.items()}
    ep = nns.plan(model, strategy="ep", world_size=world, example_inputs=half, **options)
    meg = nns.plan(model, strategy="megatron", world_size=world, example_inputs=half, **options)
    assert meg.mesh == ep.mesh, (meg.mesh.describe(), ep.mesh.describe())
    assert meg.ops == ep.ops and meg.knobs == ep.knobs
    assert meg.knobs.experts_as_one_op  # captured with each MoE layer's experts as one op, as ep captures


def test_megatron_without_experts_degrees_stays_megatron():
    import nnscaler_plugins as nns

    model, batch = mixtral()
    half = {k: v[:2] for k, v in batch.items()}
    plan = nns.plan(model, strategy="megatron", world_size=2, tp=2, example_inputs=half)
    assert plan.mesh.describe() == "tp 2" and not plan.knobs.experts_as_one_op, plan.mesh.describe()


@pytest.mark.parametrize("bad,world,words", [
    ({"ep": 2, "cp": 2}, 4, "cp=2 with ep= / etp= is not supported"),
    ({"ep": 2, "pp": 2, "virtual_stages": 2}, 4, "interleaved schedule"),
    ({"ep": 2, "sequence_parallel": True}, 2, "sequence_parallel=True with ep="),
])
def test_what_megatron_cannot_combine_with_experts_is_refused_by_name(bad, world, words):
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    model, batch = mixtral()
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace("=", "=")):
        nns.plan(model, strategy="megatron", world_size=world, example_inputs={k: v[:2] for k, v in batch.items()},
                 **bad)


def _train(rank: int, world: int) -> list[str]:
    return sgd_equivalence(rank, world, MODELS["mixtral"], "megatron", {"ep": 2}, 1, what="mixtral megatron ep=2",
                           training=True)


def test_megatron_with_ep_trains_like_one_process(workers2):
    problems = workers2.run(_train, timeout=300)
    assert not any(problems), problems
