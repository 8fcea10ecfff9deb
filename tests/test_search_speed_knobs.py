"""compile and fp8 in the cost model and the search's space.

compile=True is priced through the efficiency model on clusters with a GPU kernel table: element-wise
chains fused (`Efficiency.fused_elementwise`, what a stack that fuses by hand is priced with), the
presets pricing this runtime's eager code unfused; fp8 prices the converted linears at the cluster's
fp8 peak plus their casts. The search puts them in its space where the preset supports them
(compile=None, fp8=True) and `auto` may choose them (choose_compile, choose_fp8).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import nnscaler_plugins as nns


@pytest.fixture(scope="module")
def llama_8b_layer():
    """One Llama-3-8B layer at sequence 8192 (meta weights): float8 pays at these sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=32000, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    return nns.capture(model, kwargs={"input_ids": ids, "labels": ids})


def _step(graph, cluster, **options) -> float:
    return nns.simulate(nns.plan(graph, strategy="dp", world_size=1, **options), cluster).step_time_s


def test_compile_and_fp8_are_priced_where_the_cluster_has_them(llama_8b_layer):
    h100, a100 = nns.cluster("h100-dgx"), nns.cluster("a100-dgx")
    eager = _step(llama_8b_layer, h100, precision="bf16")
    compiled = _step(llama_8b_layer, h100, precision="bf16", compile=True)
    # one model of compilation: a compiled plan costs what the same eager plan costs on a stack that fuses
    # its element-wise chains, and that is faster than one kernel per op
    fused = replace(h100, efficiency=replace(h100.efficiency, fused_elementwise=True))
    assert compiled == pytest.approx(_step(llama_8b_layer, fused, precision="bf16"))
    assert compiled == pytest.approx(_step(llama_8b_layer, fused, precision="bf16", compile=True))
    assert eager / compiled > 1.02
    fp8 = _step(llama_8b_layer, h100, precision="fp8", compile=True)
    assert fp8 < 0.9 * compiled  # torchtitan: 8,532 vs 6,667 tokens/s
    # an A100 has no float8 units: its fp8 plan is priced as bf16 plus nothing
    assert _step(llama_8b_layer, a100, precision="fp8") == pytest.approx(_step(llama_8b_layer, a100, precision="bf16"))
    # the local CPU preset measures eager PyTorch: no discount
    cpu = nns.cluster("local-cpu", devices=1, measure=False)
    assert _step(llama_8b_layer, cpu, compile=True) == pytest.approx(_step(llama_8b_layer, cpu))


def _estimate(graph, cluster, **options):
    return nns.simulate(nns.plan(graph, strategy="dp", world_size=1, **options), cluster)


def test_compiled_loss_and_float8_saved_inputs_are_priced_in_memory(llama_8b_layer):
    """What compilation and float8 change in memory: a compiled loss keeps the logits in bf16 instead of
    their fp32 upcast and log-probabilities (unless the stack compiles the blocks only), and a stack
    whose float8 products keep their inputs in float8 (Transformer Engine) keeps fewer activation bytes
    than one that keeps them in bf16 (torchao)."""
    h100 = nns.cluster("h100-dgx")
    eager = _estimate(llama_8b_layer, h100, precision="bf16")
    compiled = _estimate(llama_8b_layer, h100, precision="bf16", compile=True)
    logits = 8192 * 32000  # one sequence of 8192 tokens, vocabulary 32000
    assert eager.memory["activations"] - compiled.memory["activations"] >= 2 * logits * 0.99
    blocks_only = replace(h100, efficiency=replace(h100.efficiency, compiled_loss=False))
    assert _estimate(llama_8b_layer, blocks_only, precision="bf16", compile=True).memory["activations"] == \
        pytest.approx(eager.memory["activations"])
    torchao = _estimate(llama_8b_layer, h100, precision="fp8")
    te = _estimate(llama_8b_layer, replace(h100, efficiency=replace(h100.efficiency, fp8_saves_float8=True)),
                   precision="fp8")
    assert torchao.memory["activations"] == pytest.approx(eager.memory["activations"])
    assert te.memory["activations"] < 0.95 * torchao.memory["activations"]


def test_search_and_auto_choose_compile_and_fp8_where_supported(llama_8b_layer):
    found = nns.search(llama_8b_layer, world_size=1, cluster="h100-dgx", precision="bf16", compile=None, fp8=True,
                       progress=False)
    assert found.best.knobs.compile and found.best.precision == "fp8"
    on_a100 = nns.search(llama_8b_layer, world_size=1, cluster="a100-dgx", precision="bf16", compile=None, fp8=True,
                         progress=False)
    assert on_a100.best.knobs.compile and on_a100.best.precision == "bf16"
    plain = nns.search(llama_8b_layer, world_size=1, cluster="h100-dgx", precision="bf16", progress=False)
    assert not plain.best.knobs.compile and plain.best.precision == "bf16"  # opt-in: nothing changes by default
    plan = nns.plan(llama_8b_layer, strategy="auto", world_size=1, cluster="h100-dgx", choose_compile=True,
                    choose_fp8=True)
    assert plan.knobs.compile and plan.precision == "fp8"
    assert nns.simulate(plan, nns.cluster("h100-dgx")).step_time_s < 0.9 * plain.estimates[0].step_time_s


def test_compiled_float8_casts_fold_their_amax_into_the_producer(llama_8b_layer):
    """A float8 product's casts: eager, an amax read then a read and a half-size write of each operand
    (FP8_CAST_PASSES); compiled, an activation's amax rides in the kernel that produced it (one pass
    less over X forward, over dY for dX, over both for dW), a weight's cast keeps every pass."""
    from nnscaler_plugins.plan.float8 import float8_linears
    from nnscaler_plugins.search.costmodel import FP8_CAST_PASSES, CostModel, Training
    from nnscaler_plugins.search.layouts import Placement

    graph, h100 = llama_8b_layer, nns.cluster("h100-dgx")
    plan = nns.plan(graph, strategy="dp", world_size=1)
    cm = CostModel(graph, h100)
    name = float8_linears(graph)[0]
    p = Placement.of(plan.ops[name])
    f8 = frozenset([name])
    times = {}
    for fp8, compiled in ((False, False), (True, False), (False, True), (True, True)):
        t = Training(dtype="bf16", fp8_ops=f8 if fp8 else frozenset(), compiled=compiled)
        times[fp8, compiled] = cm.op_time(name, p, t)
    x, w, y = cm.operand_bytes(cm.costs.ops[name], p, 2, 1)
    assert x > 0 and w > 0 and y > 0
    # compiling changes nothing else about a product: all it saves is the activations' amax passes
    plain = [getattr(times[False, False], k) - getattr(times[False, True], k) for k in ("fwd", "bwd_input", "bwd_weight")]
    assert plain == [0.0, 0.0, 0.0]
    saved = [getattr(times[True, False], k) - getattr(times[True, True], k) for k in ("fwd", "bwd_input", "bwd_weight")]
    # one pass over X forward, over dY for dX, over both for dW; none over W
    for got, nbytes in zip(saved, (x, y, x + y)):
        assert got > 0 and got / nbytes == pytest.approx(saved[0] / x, rel=1e-6), (saved, x, y)
