"""Kernel tables and overlap switches: each shipped table reproduces the public points it cites, the cost
model reads a matmul's efficiency at the piece's own GEMM shape, and every overlap switch moves the
simulated step the way its mechanism says."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.kernel_tables import KernelTable, kernel_table
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.opcost import OpCosts
from nnscaler_plugins.search.overlap import Overlap, not_run_as_priced

SHIPPED = ("a100", "h100", "h200", "v100")


@pytest.mark.parametrize("name", SHIPPED)
def test_table_reproduces_its_points(name):
    t = kernel_table(name)
    assert t.points and t.sources
    for p in t.points:
        assert t.point_efficiency(p) == pytest.approx(p["efficiency"], rel=0.10), p
    again = KernelTable.from_json(t.to_json())
    assert again == t


def test_curves_are_physical():
    h100 = kernel_table("h100")
    big = h100.matmul_efficiency(8192, 8192, 8192, 1, "bf16")
    assert h100.matmul_efficiency(512, 512, 8192, 1, "bf16") < big  # fewer output tiles than SMs
    assert h100.matmul_efficiency(8192, 8192, 64, 1, "bf16") < big  # short contraction
    assert h100.matmul_efficiency(512, 512, 64, 64, "bf16") > h100.matmul_efficiency(512, 512, 64, 1, "bf16")
    f3 = h100.attention_efficiency(4096, 128, False, False, "flash3")
    assert f3 > h100.attention_efficiency(4096, 128, False, False, "flash2")
    assert f3 > h100.attention_efficiency(512, 128, False, False, "flash3") > 0
    assert h100.memory_efficiency(1e3) < h100.memory_efficiency(1e9) <= h100.memory_fraction
    assert kernel_table("v100").attention_efficiency(2048, 128, False, False) is None
    with pytest.raises(ValueError, match="no kernel table"):
        kernel_table("tpu-v9")


def _gpt2(attn: str = "eager"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=1024, n_head=8, vocab_size=4096, n_positions=512, use_cache=False)
    cfg._attn_implementation = attn
    with torch.device("meta"):
        m = GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")  # meta: a GPU-sized layer costs nothing to capture
    return nns.capture(m, kwargs={"input_ids": ids, "labels": ids})


@pytest.fixture(scope="module")
def graph():
    return _gpt2("sdpa")


def test_matmul_priced_at_its_piece_shape(graph):
    spec = nns.cluster("h100-dgx")
    cm = CostModel(graph, spec)
    fc = next(op for op in graph.ops if op.short_name == "addmm" and cm.costs.ops[op.name].gemm
              and dict(cm.costs.ops[op.name].gemm[0])["n"] == 4096)
    c = cm.costs.ops[fc.name]
    whole = cm.op_time(fc.name, Placement(), Training("bf16"))
    eff = spec.kernels.matmul_efficiency(1024, 4096, 1024, 1, "bf16") * spec.efficiency.sustained
    assert whole.fwd == pytest.approx(c.flops / (989e12 * eff) + spec.efficiency.op_overhead_s, rel=1e-6)
    # split 8 ways over n: each piece is a narrower GEMM with fewer tiles, so less efficient per FLOP
    piece = cm.op_time(fc.name, Placement((("n", 8),), 1, (), tuple(range(8))), Training("bf16"))
    assert piece.fwd - spec.efficiency.op_overhead_s > (whole.fwd - spec.efficiency.op_overhead_s) / 8
    sdpa = next(op for op in graph.ops if cm.costs.ops[op.name].attn)
    label, sq, sk, hd, causal = cm.costs.ops[sdpa.name].attn
    assert (sq, sk, hd, causal) == (512, 512, 128, True)
    t3 = cm.op_time(sdpa.name, Placement(), Training("bf16")).fwd
    fa2 = replace(spec, efficiency=replace(spec.efficiency, attention_kernel="flash2"))
    assert CostModel(graph, fa2).op_time(sdpa.name, Placement(), Training("bf16")).fwd > t3


def test_overlap_switches_move_the_step(graph):
    spec = nns.cluster("h100-dgx", nodes=2)

    def step(strategy, **options):
        plan = nns.plan(graph, strategy=strategy, world_size=16, cluster=spec, **options)
        return nns.simulate(plan, spec)

    tp_on = step("megatron", tp=8, tp_comm_overlap=True)
    tp_off = step("megatron", tp=8, tp_comm_overlap=False)
    assert tp_on.step_time_s < tp_off.step_time_s
    assert "not_run_as_priced" not in tp_on.details  # the runtime pipelines them (lower/tp_overlap.py)
    assert "not_run_as_priced" not in tp_off.details
    dp_on = step("dp")
    dp_off = step("dp", overlap_grad_reduce=False)
    assert dp_on.step_time_s < dp_off.step_time_s
    z3_on = step("megatron", tp=1, zero=3)
    z3_off = step("megatron", tp=1, zero=3, overlap_param_gather=False)
    assert z3_on.step_time_s < z3_off.step_time_s
    pp_on = step("1f1b", pp=2, micro_batches=4)
    pp_off = step("1f1b", pp=2, micro_batches=4, overlap_p2p=False)
    assert pp_on.step_time_s < pp_off.step_time_s


def test_overlap_arithmetic():
    o = Overlap(tp_comm=True, kappa=1.2)
    assert o.tp_exposed(8.0, 100.0, 8) == pytest.approx(1.0 + 0.2 * 7.0)  # 1/t exposed, the rest hidden with kappa
    assert o.tp_exposed(8.0, 2.0, 4) == pytest.approx(2.0 + 4.0 + 0.2 * 2.0)  # hides only behind what compute there is
    assert Overlap(tp_comm=False).tp_exposed(8.0, 100.0, 8) == 8.0
    assert Overlap(kappa=None).hidden_behind(3.0, 10.0) == 3.0
    cpu = nns.cluster("local-cpu", devices=2, measure=False)
    assert Overlap.of({"tp_comm_overlap": True}, cpu) == Overlap(False, False, False, False, None)
    h100 = nns.cluster("h100-dgx")
    assert not_run_as_priced({}, h100, zero=0, tp=False) == []
    assert not_run_as_priced({}, h100, zero=1, tp=True) == []  # tp overlap and ZeRO-1's gather both run
    assert not_run_as_priced({"overlap_param_gather": False}, h100, zero=3, tp=False) == []
    assert not_run_as_priced({"overlap_p2p": False}, h100) == ["overlap_p2p=False"]  # sends are always async


def test_written_out_attention_priced_as_flash_on_fusing_stacks(graph):
    """Attention written out (matmul, mask, softmax, matmul) on a stack that fuses it costs what the
    same model with scaled_dot_product_attention costs; on the 2021 stack it stays unfused (slower, and
    its score matrices are stored)."""
    eager = _gpt2("eager")
    costs = OpCosts.of(eager)
    core = [op.short_name for op in eager.ops if costs.ops[op.name].core]
    assert core and all(costs.ops[op.name].core_causal for op in eager.ops if costs.ops[op.name].core)

    def run(g, preset, **stack):
        spec = nns.cluster(preset)
        spec = replace(spec, efficiency=replace(spec.efficiency, **stack))
        return nns.simulate(nns.plan(g, strategy="megatron", world_size=8, tp=8), spec)

    # Megatron-Core's stack: flash attention for the core and its hand-fused element-wise kernels around it
    fused, flash = run(eager, "h100-dgx", fused_elementwise=True), run(graph, "h100-dgx", fused_elementwise=True)
    # The written-out model also builds its causal mask as a tensor each step (about 20 small ops,
    # 8 % of this tiny model's step); the sdpa model's mask is folded into is_causal at capture and
    # its builder removed. An attention core priced unfused would cost several times more.
    assert flash.step_time_s < fused.step_time_s < 1.10 * flash.step_time_s
    assert fused.max_memory_bytes == pytest.approx(flash.max_memory_bytes, rel=0.05)
    unfused, flash_a100 = run(eager, "a100-dgx"), run(graph, "a100-dgx")
    assert unfused.step_time_s > flash_a100.step_time_s and unfused.max_memory_bytes > flash_a100.max_memory_bytes


def test_h200_is_h100_with_more_memory(graph):
    h100, h200 = nns.cluster("h100-dgx"), nns.cluster("h200")
    plan = nns.plan(graph, strategy="dp", world_size=8)
    a, b = nns.simulate(plan, h100), nns.simulate(plan, h200)
    assert b.step_time_s <= a.step_time_s  # same compute, faster memory-bound ops
    assert b.step_time_s > 0.7 * a.step_time_s


def _reduce_after_backward(rank: int, world: int) -> list[str]:
    """A dp plan with overlap_grad_reduce=False: no bucket starts during backward, and training is
    exactly one process's."""
    import models
    from sgd_check import sgd_equivalence

    import nnscaler_plugins as nns

    def build():
        model, batch = models.mlp()
        return model, batch

    model, batch = build()
    pm = nns.parallelize(model, {k: v[:v.shape[0] // 2] for k, v in batch.items()}, plan="dp",
                         overlap_grad_reduce=False, cache_dir="/tmp/nns_test_cache")
    problems = sgd_equivalence(rank, world, build, "dp", {"overlap_grad_reduce": False}, dp=2)
    if pm.grad_reducer is None or pm.grad_reducer.overlap:
        problems.append("the reducer overlaps although the plan says overlap_grad_reduce=False")
    return problems


def test_runtime_reduces_after_backward_when_asked(workers2):
    for problems in workers2.run(_reduce_after_backward):
        assert problems == []
