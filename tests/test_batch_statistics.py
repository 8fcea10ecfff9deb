"""The router loss under every data-parallel strategy: a mixture-of-experts model's load-balancing
loss multiplies two statistics over the whole batch, so replicas that each computed their own would
train differently from one process. dp and zero2 at world 2 (HF Mixtral, top-2 routing, aux loss on,
padding in one replica's rows only) equal one process on the whole batch (SGD, fp32, relative 1e-5);
`batch_statistics="local"` keeps each replica's own statistics (DDP's behaviour) and differs;
micro-batches are refused by name unless "local"; a ready-made plan (from `nns.search`) gets the
same; models without such statistics (a dense model, batch norm in eval mode) record nothing and
are not refused. Batch norm in training: tests/test_batch_norm_statistics.py.
NNS_TEST_ALL_PLANS=1 adds hybrid, the pipelines, megatron, auto and the other MoE models.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from sgd_check import sgd_equivalence
from test_expert_parallel import LAYERS, MODELS

EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"


def _equivalence(rank, world, name, strategy, options, dp):
    return sgd_equivalence(rank, world, MODELS[name], strategy, options, dp, what=f"{name} {strategy} {options}")


@pytest.mark.parametrize("name,strategy,options,dp",
                         [("mixtral_padded", "dp", {}, 2), ("mixtral_padded", "zero2", {}, 2)]
                         + ([("mixtral", "dp", {}, 2), ("qwen3_moe", "zero3", {}, 2), ("qwen2_moe", "dp", {}, 2),
                             ("mixtral_padded", "hybrid", {"tp": 1, "dp": 2}, 2), ("mixtral", "tp", {}, 1),
                             ("mixtral", "1f1b", {}, 1), ("mixtral", "interlaced", {}, 1),
                             ("qwen3_moe", "megatron", {"tp": 2}, 1), ("mixtral", "auto", {}, 1)]
                            if EVERY else []))
def test_router_loss_equals_one_process(workers2, name, strategy, options, dp):
    problems = workers2.run(_equivalence, name, strategy, options, dp)
    assert not any(problems), problems


def test_local_statistics_are_each_replicas_own(workers2):
    """What the default corrects: each replica's own router statistics give another loss."""
    problems = workers2.run(_equivalence, "mixtral_padded", "dp", {"batch_statistics": "local"}, 2)
    assert all(any("step 0: loss" in p for p in ps) for ps in problems), problems


@pytest.fixture(scope="module")
def mixtral_graph():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = MODELS["mixtral"]()
    return nns.capture(model, kwargs=batch)


def test_recorded_for_each_data_parallel_strategy_and_combined_in_the_program(mixtral_graph):
    import nnscaler_plugins as nns
    from nnscaler_plugins.lower import lower

    for strategy, world, options in (("dp", 2, {}), ("zero1", 2, {}), ("hybrid", 4, {"tp": 2, "dp": 2}),
                                     ("gpipe", 4, {"pp": 2, "dp": 2}), ("megatron", 4, {"tp": 2, "dp": 2})):
        plan = nns.plan(mixtral_graph, strategy=strategy, world_size=world, **options)
        stats = plan.knobs.batch_statistic_ops
        assert plan.knobs.batch_statistics == "global" and len(stats) == 2 * LAYERS, (strategy, stats)
        if strategy == "hybrid":
            program = lower(mixtral_graph, plan)
            assert program.collective_counts(0)["kernel:across_replicas"] == 2 * LAYERS


def _replicas(builder, **_):
    for op in builder.ops:
        builder.replicate(op, devices=[0])


_replicas.degrees = lambda world_size, **_: (1, world_size)  # type: ignore[attr-defined]


def test_a_strategy_that_does_not_look_gets_them(mixtral_graph):
    """A plugin's strategy (or cp) that never calls `apply_batch_statistics`: its replicas still
    combine the router statistics, and its micro-batches are refused by name."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    plan = nns.plan(mixtral_graph, strategy=_replicas, world_size=2)
    assert len(plan.knobs.batch_statistic_ops) == 2 * LAYERS
    with pytest.raises(PlanError, match="2 micro-batches"):
        nns.plan(mixtral_graph, strategy=_replicas, world_size=2, micro_batches=2)


def test_micro_batches_refused_by_name_unless_local(mixtral_graph):
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    for strategy, options in (("dp", {}), ("1f1b", {"pp": 2})):
        with pytest.raises(PlanError, match="2 micro-batches.*batch_statistics='local'") as info:
            nns.plan(mixtral_graph, strategy=strategy, world_size=2, micro_batches=2, **options)
        assert info.value.op in nns.plan(mixtral_graph, strategy=strategy, world_size=2, **options
                                         ).knobs.batch_statistic_ops
        local = nns.plan(mixtral_graph, strategy=strategy, world_size=2, micro_batches=2, batch_statistics="local",
                         **options)
        assert local.knobs.batch_statistics == "local" and not local.knobs.batch_statistic_ops
    with pytest.raises(PlanError, match="batch_statistics='sync'; use 'global' or 'local'"):
        nns.plan(mixtral_graph, strategy="tp", world_size=2, batch_statistics="sync")


def test_searched_plan_gets_them_or_is_refused(mixtral_graph):
    """A ready-made plan (here from `nns.search`) did not go through a strategy: the statistics are
    found when it is planned or run, and its micro-batches are refused with the way out."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    whole = next(p for p in nns.search(mixtral_graph, world_size=2, progress=False) if p.dp == 2)
    assert whole.num_micro_batches == 1 and not whole.knobs.batch_statistic_ops
    assert len(nns.plan(mixtral_graph, strategy=whole, world_size=2).knobs.batch_statistic_ops) == 2 * LAYERS
    micro = dataclasses.replace(whole, micro_batches=2)
    with pytest.raises(PlanError, match="micro-batches.*batch_statistics='local'"):
        nns.plan(mixtral_graph, strategy=micro, world_size=2)
    micro = dataclasses.replace(micro, knobs=micro.knobs.replace(batch_statistics="local"))
    assert nns.plan(mixtral_graph, strategy=micro, world_size=2).knobs.batch_statistics == "local"


def test_dense_models_and_batch_norm_in_eval_record_nothing_and_take_micro_batches():
    """A mean loss is linear in its batch reductions, and batch norm in eval mode uses its running
    statistics: neither is a statistic to combine nor a reason to refuse micro-batches. (Batch norm
    in training is one: tests/test_batch_norm_statistics.py.)"""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    from test_zoo import ConvBN

    bn = ConvBN().eval()
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for model, inputs in ((bn, (torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))), (dense, (torch.randn(4, 8),))):
        for strategy in ("dp", "zero2", "tp"):
            plan = nns.plan(model, strategy=strategy, world_size=2, example_inputs=inputs, micro_batches=2)
            assert not plan.knobs.batch_statistic_ops, (strategy, plan.knobs)
