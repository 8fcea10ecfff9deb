"""The cost model: FLOPs, saved activations, communication and model states from the graph alone."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.plan.layers import layer_groups
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.network import Network
from nnscaler_plugins.search.opcost import OpCosts
from nnscaler_plugins.search.profiler import OpProfiler
from nnscaler_plugins.search.segments import Walker

B, S, H, A, V, L = 2, 32, 64, 4, 128, 2


def gpt(attn="eager", layers=L):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=H, n_head=A, vocab_size=V, n_positions=S, activation_function="gelu",
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    return nns.capture(model, kwargs={"input_ids": ids, "labels": ids})


@pytest.fixture(scope="module")
def graph():
    return gpt()


def megatron(graph, tp, **opts):
    from nnscaler_plugins.plan.primitives import PlanBuilder
    from nnscaler_plugins.plugins import get_strategy

    st = get_strategy("megatron")
    b = PlanBuilder(graph, tp, 1, strategy="megatron", micro_batches=1)
    st(b, tp=tp, pp=1, **opts)
    return b.finish()


def layer_segment(graph, plan, spec, training, layer=1):
    cm = CostModel(graph, spec)
    ops = layer_groups(graph).layers[layer]
    walker = Walker(graph, cm, training, 1, sp_layers={op.name for op in ops})
    return walker.run(ops, lambda n: Placement.of(plan.ops[n]), lambda n: 0)[0], cm


def test_matmul_flops(graph):
    costs = OpCosts.of(graph)
    layer = layer_groups(graph).layers[0]
    flops = sum(costs.ops[op.name].flops for op in layer if costs.ops[op.name].kind == "matmul")
    assert flops == 24 * B * S * H * H + 4 * B * S * S * H  # Megatron's per-layer forward FLOPs
    addmm = next(op for op in layer if op.short_name == "addmm")
    c = costs.ops[addmm.name]
    assert c.flops == 2 * B * S * H * 3 * H and c.flops_weight_grad == c.flops and c.flops_input_grad == c.flops


def test_saved_activations_are_korthikantis(graph):
    spec = nns.cluster("a100-dgx")
    plan = megatron(graph, 1)
    seg, _ = layer_segment(graph, plan, spec, Training("bf16"))
    assert seg.activations == S * B * H * 34 + 5 * A * S * S * B  # bytes per layer, 16-bit activations


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_activations_and_communication(graph, t):
    spec = nns.cluster("a100-dgx")
    plan = megatron(graph, t)
    training = Training("bf16")
    seg, cm = layer_segment(graph, plan, spec, training)
    assert seg.activations == pytest.approx(S * B * H * (10 + 24 / t + 5 * A * S / (H * t)))
    # two all-reduces of the layer's output in forward (row-parallel outputs), two in backward (inputs of
    # the column-parallel matmuls)
    ar = Network(spec).all_reduce(B * S * H * 2, cm._span(range(t)))
    assert seg.bwd_comm == pytest.approx(2 * ar, rel=0.01)  # gradient sums at the column-parallel inputs
    if t == 2:
        assert seg.fwd_comm == pytest.approx(2 * ar, rel=0.01)
    else:  # the resharding search finds that these tiny, latency-bound sums go faster over pairs
        assert 0 < seg.fwd_comm <= 2 * ar
    sp = Training("bf16", sequence_parallel=True)
    seg_sp, _ = layer_segment(graph, plan, spec, sp)
    assert seg_sp.activations == pytest.approx(S * B * H / t * (34 + 5 * A * S / H))


@pytest.mark.parametrize("t", [2, 4])
def test_placed_sequence_parallel_keeps_gathered_inputs_as_shards(graph, t):
    """The sequence splits placed in the plan (not the what-if): the all-gathered inputs of the
    column-parallel matmuls are kept as their shards, as the runtime does, so a layer keeps
    Korthikanti's sbh(34/t + 5as/(ht))."""
    spec = nns.cluster("a100-dgx")
    plan = megatron(graph, t, sequence_parallel=True)
    cm = CostModel(graph, spec)
    ops = layer_groups(graph).layers[1]
    walker = Walker(graph, cm, Training("bf16", sequence_parallel=True), 1)
    seg = walker.run(ops, lambda n: Placement.of(plan.ops[n]), lambda n: 0)[0]
    assert seg.activations == pytest.approx(S * B * H / t * (34 + 5 * A * S / H))


def test_views_cost_a_dispatch_where_the_stack_says(graph):
    spec = nns.cluster("a100-dgx")
    layer = layer_groups(graph).layers[0]
    view = next(op for op in layer if CostModel(graph, spec).costs.ops[op.name].kind == "view")
    assert CostModel(graph, spec).op_time(view.name, Placement(), Training("bf16")).fwd == 0.0
    eager = replace(spec, efficiency=replace(spec.efficiency, view_overhead_s=4e-6))
    t = CostModel(graph, eager).op_time(view.name, Placement(), Training("bf16"))
    assert t.fwd == 4e-6 and t.bwd_input == 4e-6


def test_selective_recompute_drops_the_attention_core(graph):
    costs = OpCosts.of(graph)
    layer = layer_groups(graph).layers[0]
    core = [op.short_name for op in layer if costs.ops[op.name].core]
    assert core == ["matmul", "mul", "add", "softmax", "to", "dropout", "matmul"]
    spec = nns.cluster("a100-dgx")
    seg, _ = layer_segment(graph, megatron(graph, 1), spec, Training("bf16"))
    assert seg.act_bytes("selective") == S * B * H * 34
    assert seg.recompute_time("selective")[0] > 0


def test_model_states_per_zero_stage():
    psi, d = 1e9, 8
    zero_paper = [Training("bf16", zero=z, grad_bytes=2) for z in range(4)]  # ZeRO paper: 16 bytes per parameter
    totals = [sum(t.state_bytes(psi, d).values()) for t in zero_paper]
    assert totals == pytest.approx([16 * psi, 4 * psi + 12 * psi / d, 2 * psi + 14 * psi / d, 16 * psi / d])
    megatron_recipe = Training("bf16")  # fp32 main gradients: 18 bytes, what Korthikanti's memory figures count
    assert sum(megatron_recipe.state_bytes(psi, 1).values()) == 18 * psi
    assert sum(Training("fp32").state_bytes(psi, 1).values()) == 16 * psi  # no master copy


def test_roofline(graph):
    spec = replace(nns.cluster("a100-dgx"), kernels=None)  # the two-constant roofline (tables: test_simulator_tables)
    cm = CostModel(graph, spec)
    eff = spec.efficiency
    layer = layer_groups(graph).layers[0]
    addmm = next(op for op in layer if op.short_name == "addmm")
    t = cm.op_time(addmm.name, Placement(), Training("bf16"))
    c = cm.costs.ops[addmm.name]
    nbytes = sum(u.numel * 2 for u in c.inputs + c.outputs)
    assert t.fwd == pytest.approx(max(c.flops / (312e12 * eff.matmul), nbytes / (spec.memory_bandwidth * eff.memory))
                                  + eff.op_overhead_s)
    half = cm.op_time(addmm.name, Placement((("n", 2),), 1, (), (0, 1)), Training("bf16"))
    assert half.flops == c.flops / 2
    gelu = next(op for op in layer if op.short_name == "gelu")
    g = cm.op_time(gelu.name, Placement(), Training("bf16"))
    assert g.fwd == pytest.approx(2 * B * S * 4 * H * 2 / (spec.memory_bandwidth * eff.memory) + eff.op_overhead_s)
    # the presets price this runtime's eager code (one kernel per op); a stack that fuses element-wise
    # chains (Megatron's kernels, a compiled plan) does not write the chain's intermediates
    assert not eff.fused_elementwise
    fused = CostModel(graph, replace(spec, efficiency=replace(eff, fused_elementwise=True)))
    drop = next(op for op in layer if op.short_name == "dropout")  # after softmax: fused with it
    assert fused.op_time(drop.name, Placement(), Training("bf16")).fwd < cm.op_time(drop.name, Placement(),
                                                                                      Training("bf16")).fwd


def test_profiling_mode_measures_ops():
    graph = gpt(layers=1)
    spec = nns.cluster("local-cpu", devices=2, measure=False)
    prof = OpProfiler(repeat=2)
    cm = CostModel(graph, spec, profiler=prof)
    layer = layer_groups(graph).layers[0]
    addmm = next(op for op in layer if op.short_name == "addmm")
    t = cm.op_time(addmm.name, Placement(), Training("fp32"))
    assert t.fwd > 0 and t.bwd > 0 and prof.measured == 1
    cm.op_time(addmm.name, Placement(), Training("fp32"))
    assert prof.measured == 1  # cached per shape
    plan = nns.plan(graph, strategy="dp", world_size=2)
    est = nns.simulate(plan, spec, cost_model=cm)
    assert est.step_time_s > 0 and prof.measured > 5


def test_a_stack_that_fuses_by_hand_keeps_only_what_its_kernels_cannot_recompute():
    """Transformer Engine's RMSNorm and SwiGLU kernels recompute their intermediates in backward: the
    normalized copy an eager RMSNorm keeps for its weight's product, and the gate's activation an eager
    SwiGLU keeps beside the gate and up projections, are not kept on a stack that fuses by hand; the
    norm's input, the inverse RMS, both projections and every matmul operand are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ffn, layers = 3 * H, 2
    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=layers, num_attention_heads=A, num_key_value_heads=A,
                      intermediate_size=ffn, vocab_size=V, max_position_embeddings=S, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    g = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    spec = nns.cluster("h100-dgx")
    eager = CostModel(g, spec)
    fused = CostModel(g, replace(spec, efficiency=replace(spec.efficiency, fused_elementwise=True)))
    t = Training("bf16")

    def kept(cm):
        out = {}
        for op in g.ops:
            for base, nbytes, _ in cm.saved(op.name, Placement(), t):
                out[base] = max(out.get(base, 0.0), nbytes)
        return out

    a, b = kept(eager), kept(fused)
    assert set(b) < set(a)
    dropped = sum(a[k] for k in set(a) - set(b))
    # per layer two normalized copies (B S H) and one activation (B S ffn); the final norm's copy once more
    assert dropped == (2 * layers + 1) * B * S * H * 2 + layers * B * S * ffn * 2
    # what is dropped is written by an element-wise op from tensors still kept
    for k in set(a) - set(b):
        assert g.op(next(op.name for op in g.ops if k in op.outputs)).short_name in ("mul", "silu", "_to_copy", "to")


def test_dtensors_loss_parallel_holds_one_more_logits_tensor_in_backward_where_the_vocabulary_is_split(graph):
    """torchtitan's eager loss over vocabulary-split logits is DTensor's loss_parallel, whose backward holds
    a zeroed one-hot, the exponential of the log-probabilities and their sum beside the saved
    log-probabilities: one fp32 logits tensor (this device's classes) more than a fused cross-entropy.
    Nothing changes where the classes are whole, or where the loss is compiled."""
    spec = nns.cluster("h100-dgx")
    plain = CostModel(graph, spec)
    dtensor = CostModel(graph, replace(spec, efficiency=replace(spec.efficiency, loss_parallel_written_out=True)))
    loss = next(op.name for op in graph.ops if op.short_name == "cross_entropy_loss")
    t = Training("bf16")
    for tp in (1, 2, 4):
        plan = megatron(graph, tp)
        p = Placement.of(plan.ops[loss])
        logits = max(plain.costs.ops[loss].inputs, key=lambda u: u.numel)
        split = p.label_counts().get(logits.labels[-1], 1)
        extra = dtensor.backward_working_set(loss, p, t) - plain.backward_working_set(loss, p, t)
        assert split == tp
        assert extra == (logits.numel * 4 / tp if tp > 1 else 0.0)
        compiled = Training("bf16", compiled=True)
        assert dtensor.backward_working_set(loss, p, compiled) == plain.backward_working_set(loss, p, compiled)
