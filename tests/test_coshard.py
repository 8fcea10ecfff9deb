"""Co-shard: each device runs several pieces of a split op one after another, recomputing each in
backward. Same results and the same communication as the plain split, less activation memory."""
from __future__ import annotations

import models
import pytest
import torch
from test_equivalence import run_case

import nnscaler_plugins as nns
from nnscaler_plugins import PlanBuilder, PlanError, op_assign, op_trans
from nnscaler_plugins.lower.lowering import lower


@pytest.fixture(scope="module")
def swin_graph():
    torch.manual_seed(0)
    model, inputs = models.swin_small()
    return nns.capture(model, kwargs=inputs)


@pytest.mark.parametrize("chunks", [2, 4])
def test_coshard_equivalence_2(workers2, chunks):
    problems = workers2.run(run_case, "swin_small", "coshard", {"chunks": chunks})
    assert not any(problems), problems


def test_coshard_equivalence_4(workers4):
    problems = workers4.run(run_case, "swin_small", "coshard", {"chunks": 2})
    assert not any(problems), problems


def test_coshard_keeps_the_communication_of_tp(swin_graph):
    tp = lower(swin_graph, nns.plan(swin_graph, strategy="tp", world_size=2))
    co_plan = nns.plan(swin_graph, strategy="coshard", world_size=2, chunks=2)
    co = lower(swin_graph, co_plan)
    assert any(p.coshard == 2 for p in co_plan.ops.values())
    for device in range(2):
        assert co.collective_counts(device) == tp.collective_counts(device)


def forward_saved_bytes(rank: int, world: int, strategy: str, options: dict) -> int:
    from nnscaler_plugins.kernels.coshard import measure_forward
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    model, inputs = models.swin_small()
    pm = nns.parallelize(model, inputs, plan=strategy, cache_dir="/tmp/nns_test_cache", **options)
    loss, saved = measure_forward(lambda: extract_loss(pm(**inputs)))
    loss.backward()
    if strategy == "coshard":
        assert "co-shard:" in pm.generated_source() and "checkpoint" not in pm.generated_source().split("def forward")[0]
    return saved


def test_coshard_lowers_activation_memory(workers2):
    tp = workers2.run(forward_saved_bytes, "tp", {})
    co = workers2.run(forward_saved_bytes, "coshard", {"chunks": 2})
    co4 = workers2.run(forward_saved_bytes, "coshard", {"chunks": 4})
    for a, b, c in zip(tp, co, co4):
        # What forward keeps for backward: the attention scores and the MLP hidden layer are no longer
        # kept, only the blocks' inputs. More chunks keep the same; they shrink the working set of the
        # recomputation in backward (one chunk's intermediates at a time), which this does not count.
        assert b < 0.8 * a, (a, b)
        assert c == pytest.approx(b, rel=0.01)


def test_bad_coshard_assignment_is_refused(swin_graph):
    b = PlanBuilder(swin_graph, unit_size=2)
    lin = next(op for op in b.ops if op.node.short_name == "linear")
    subs = op_trans(lin, dim=lin.signature.outputs[0][-1], num=4)
    for i, sub in enumerate(subs):
        op_assign(sub, i % 2)  # pieces 0 and 2 on device 0: not consecutive
    for op in b.ops:
        if op.name != lin.name:
            b.replicate(op)
    with pytest.raises(PlanError, match="co-shard.*consecutive pieces"):
        b.finish()
