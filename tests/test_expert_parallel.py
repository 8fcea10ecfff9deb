"""Expert parallelism: MoE experts split across devices, tokens moved to them by all-to-all.

Equivalence with one process (SGD, fp32, relative 1e-5) on HF Mixtral and Qwen3-MoE with 8 experts
and top-2 routing, the router's load-balancing loss included (under ep x dp its statistics are made
whole across the replicas), and with attention tensor-parallel in smaller groups than the experts'
split (ep 4 x tp 2), and with each expert's width split too (`etp`, tensor parallelism inside each
expert, alone and with ep, tp, dp and a pipeline); expert state per device is 1/(ep x etp);
two all-to-alls per MoE layer forward and two backward, readable in the generated code; bad
degrees and models without experts refused by name before launch.
"""
from __future__ import annotations

import os

import pytest
import torch

from sgd_check import sgd_equivalence

EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
EXPERTS, TOP_K, LAYERS = 8, 2, 2


def mixtral(aux: bool = True):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, output_router_logits=aux, router_aux_loss_coef=0.05,
                                     max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


def mixtral_padded(aux: bool = True):
    """Padding in the second replica's rows only: the router loss's masked token counts differ per replica."""
    model, batch = mixtral(aux)
    mask = torch.ones_like(batch["input_ids"])
    mask[3, 5:] = 0
    labels = batch["labels"].clone()
    labels[3, 5:] = -100
    return model, {"input_ids": batch["input_ids"], "attention_mask": mask, "labels": labels}


def qwen3_moe(aux: bool = True):
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                                      output_router_logits=aux, router_aux_loss_coef=0.05,
                                      max_position_embeddings=64)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


def qwen2_moe():
    import transformers

    cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=0.05,
                                      max_position_embeddings=64)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


def deepseek_v3():
    import transformers

    cfg = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=2, topk_group=1,
                                        n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        max_position_embeddings=64)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


def other_moe(name):
    """MoE decoders the strategy was not written against (transformers 5 configs, 8 experts, top-2)."""
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    experts = dict(num_experts_per_tok=TOP_K, output_router_logits=True)
    if name == "olmoe":
        model = T.OlmoeForCausalLM(T.OlmoeConfig(**common, **experts, intermediate_size=24, num_experts=EXPERTS))
    elif name == "phimoe":
        model = T.PhimoeForCausalLM(T.PhimoeConfig(**common, **experts, intermediate_size=24,
                                                   num_local_experts=EXPERTS))
    elif name == "granitemoe":
        model = T.GraniteMoeForCausalLM(T.GraniteMoeConfig(**common, **experts, intermediate_size=24,
                                                           num_local_experts=EXPERTS))
    elif name == "gpt_oss":  # biases and gate/up rows interleaved
        model = T.GptOssForCausalLM(T.GptOssConfig(**common, **experts, head_dim=8, intermediate_size=24,
                                                   num_local_experts=EXPERTS, sliding_window=8,
                                                   layer_types=["full_attention"] * LAYERS))
    else:  # glm4_moe: a shared expert, grouped routing
        model = T.Glm4MoeForCausalLM(T.Glm4MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                                     n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                                     n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                                                     topk_group=1, head_dim=8))
    ids = torch.randint(0, 64, (4, 8))
    return model, {"input_ids": ids, "labels": ids}


OTHER_MOE = ("olmoe", "phimoe", "granitemoe", "gpt_oss", "glm4_moe")


def mixtral_no_aux():
    return mixtral(aux=False)


def qwen3_moe_no_aux():
    return qwen3_moe(aux=False)


def tiny(layout):
    """A hand-written MoE (`_TinyMoE`, below) with its experts in `layout`."""
    torch.manual_seed(0)
    return _TinyMoE(layout), {"x": torch.randn(8, 16)}


MODELS = {"tiny_biased": lambda: tiny("biased"), "tiny_interleaved": lambda: tiny("interleaved"),
          "mixtral": mixtral, "mixtral_padded": mixtral_padded, "padded_no_aux": lambda: mixtral_padded(False),
          "qwen3_moe": qwen3_moe, "mixtral_no_aux": mixtral_no_aux, "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3,
          "qwen3_moe_no_aux": qwen3_moe_no_aux,
          **{name: (lambda n=name: other_moe(n)) for name in OTHER_MOE}}


def _equivalence(rank, world, name, options, dp):
    return sgd_equivalence(rank, world, MODELS[name], "ep", options, dp, what=f"{name} ep {options}")


@pytest.mark.parametrize("name,options", [("mixtral", {"ep": 2}), ("qwen3_moe", {"ep": 1, "etp": 2}),
                                          ("tiny_biased", {"ep": 1, "etp": 2}), ("tiny_interleaved", {"ep": 1, "etp": 2})]
                         + ([(name, options) for name in OTHER_MOE for options in ({"ep": 2}, {"ep": 1, "etp": 2})]
                            if EVERY else [])
                         + ([("mixtral", {"ep": 1, "etp": 2, "tp": 2}), ("deepseek_v3", {"ep": 1, "etp": 2}),("qwen3_moe", {"ep": 2}), ("mixtral", {"ep": 2, "tp": 2}), ("qwen3_moe", {"ep": 2, "tp": 2}),
                             ("qwen2_moe", {"ep": 2}), ("deepseek_v3", {"ep": 2}), ("deepseek_v3", {"ep": 2, "tp": 2})]
                            if EVERY else []))
def test_ep_2(workers2, name, options):
    problems = workers2.run(_equivalence, name, options, 1)
    assert not any(problems), problems


@pytest.mark.parametrize("name,options,dp", [("mixtral", {"ep": 2, "dp": 2}, 2), ("mixtral", {"ep": 4, "tp": 2}, 1),
                                            ("mixtral", {"ep": 2, "etp": 2}, 1), ("mixtral", {"ep": 2, "pp": 2}, 1)]
                         + ([("qwen3_moe", {"ep": 2, "etp": 2, "tp": 2}, 1), ("qwen3_moe", {"ep": 1, "etp": 2, "pp": 2}, 1), ("qwen2_moe", {"ep": 2, "etp": 2}, 1),
                             ("deepseek_v3", {"ep": 2, "etp": 2, "tp": 2}, 1), ("mixtral", {"ep": 1, "etp": 2, "dp": 2}, 2),
                             ("mixtral_no_aux", {"ep": 1, "etp": 2, "pp": 2, "micro_batches": 2}, 1),
                             ("mixtral", {"ep": 1, "etp": 2, "dp": 2, "zero": 3}, 2),("qwen3_moe", {"ep": 4, "tp": 2}, 1), ("qwen2_moe", {"ep": 4, "tp": 2}, 1),
                             ("deepseek_v3", {"ep": 4, "tp": 2}, 1), ("qwen3_moe", {"ep": 2, "dp": 2}, 2),
                             ("qwen2_moe", {"ep": 2, "dp": 2}, 2),
                             ("mixtral_no_aux", {"ep": 2, "dp": 2}, 2), ("mixtral", {"ep": 4}, 1),
                             ("mixtral_padded", {"ep": 4}, 1), ("mixtral_padded", {"ep": 2, "dp": 2}, 2), ("padded_no_aux", {"ep": 2, "dp": 2}, 2),
                             ("qwen3_moe", {"ep": 4}, 1), ("mixtral", {"ep": 2, "dp": 2, "zero": 1}, 2),
                             ("mixtral_no_aux", {"ep": 2, "pp": 2, "micro_batches": 2}, 1)]
                            if EVERY else []))
def test_ep_4(workers4, name, options, dp):
    problems = workers4.run(_equivalence, name, options, dp)
    assert not any(problems), problems


def _memory_and_collectives(rank, world, ep, etp=1):
    """Expert parameters, gradients and optimizer state held here, and the all-to-alls of one step."""
    from collective_counts import all_to_alls

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = mixtral()
    total = {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}
    pm = nns.parallelize(model, batch, plan="ep", ep=ep, etp=etp, cache_dir="/tmp/nns_test_cache")
    opt = nns.build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    with all_to_alls() as calls:
        out = pm(**batch)
        forward = calls["all"]
        out.loss.backward()
        backward = calls["all"] - forward
    opt.step()
    held = {n: p for n, p in pm.named_parameters() if ".experts." in n or "experts" in n}
    params = sum(p.numel() for p in held.values())
    grads = sum(p.grad.numel() for p in held.values() if p.grad is not None)
    state = sum(t.numel() for p in held.values() for t in opt.state.get(p, {}).values()
                if torch.is_tensor(t) and t.ndim > 0)
    source = pm.generated_source()
    return dict(total=sum(total.values()), params=params, grads=grads, state=state, forward=forward,
                backward=backward, source=source)


@pytest.mark.parametrize("ep,etp", [(2, 1), (1, 2)])
def test_expert_memory_and_all_to_alls(workers2, ep, etp):
    """ep 2: half the experts per device, two all-to-alls per layer each way; etp 2 (tensor
    parallel inside each expert): half of every expert's width per device and no all-to-all."""
    for r in workers2.run(_memory_and_collectives, ep, etp):
        assert r["params"] == r["total"] // (ep * etp), r
        assert r["grads"] == r["total"] // (ep * etp), r
        assert r["state"] == 2 * r["total"] // (ep * etp), r  # Adam: two moments per element
        moves = 2 * LAYERS if ep > 1 else 0
        assert r["forward"] == moves and r["backward"] == moves, (r["forward"], r["backward"])
        calls = [line for line in r["source"].splitlines() if "expert_all_to_all(" in line]
        if ep > 1:
            assert calls and len(calls) % LAYERS == 0 and all("group=" in line for line in calls), calls
        else:
            assert not calls and "ExpertsCall.apply(" in r["source"]


def test_refused_before_launch():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, batch = mixtral()
    with pytest.raises(PlanError, match="ep=3 does not divide the 8 experts"):
        nns.plan(model, strategy="ep", world_size=3, ep=3, example_inputs={k: v[:3] for k, v in batch.items()})
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(PlanError, match="no recognized mixture-of-experts layers"):
        nns.plan(dense, strategy="ep", world_size=2, ep=2, example_inputs=(torch.randn(4, 8),))


def test_batch_statistics_and_capacity_in_the_plan():
    """The router loss's statistics are combined across replicas by a readable call (one per count
    and per probability sum of each layer), refused with micro-batches unless kept per replica, and
    `capacity_factor=` reaches every dispatch call."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.capture.experts import experts_as_one_op
    from nnscaler_plugins.codegen.generate import generate
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.lower import lower
    from nnscaler_plugins.kernels.expert_dispatch import expert_all_to_all

    torch.manual_seed(0)
    model, batch = mixtral()
    half = {k: v[:2] for k, v in batch.items()}
    with experts_as_one_op(model):
        graph = nns.capture(model, kwargs=half)
    plan = nns.plan(graph, strategy="ep", world_size=4, ep=2, dp=2, capacity_factor=1.5)
    assert len(plan.knobs.batch_statistic_ops) == 2 * LAYERS, plan.knobs
    program = lower(graph, plan)
    assert program.collective_counts(0)["kernel:across_replicas"] == 2 * LAYERS
    calls = [line for line in generate(program, 0).splitlines() if "across_replicas(" in line]
    assert calls and len(calls) % (2 * LAYERS) == 0, calls  # in the forward and the loss-only forward
    assert all("mean=False, group=_comm.kernel(" in c and "data-parallel replicas" in c for c in calls), calls
    dispatch = [s for s in program.ranks[0].stages[0].stmts if s.target is expert_all_to_all]
    assert len(dispatch) == LAYERS and all(s.kwargs.get("capacity_factor") == 1.5 for s in dispatch)
    with pytest.raises(PlanError, match="2 micro-batches"):
        nns.plan(graph, strategy="ep", world_size=4, ep=2, dp=2, micro_batches=2)
    local = nns.plan(graph, strategy="ep", world_size=4, ep=2, dp=2, micro_batches=2, batch_statistics="local")
    assert local.knobs.batch_statistics == "local"
    with pytest.raises(PlanError, match="capacity_factor=0"):
        nns.plan(graph, strategy="ep", world_size=2, ep=2, capacity_factor=0)


def _kernel_against_module(rank, world, capacity_factor):
    """The dispatch kernel on this rank's tokens and experts share vs the whole module on the same
    tokens (rows beyond capacity given zero weight), forward and backward."""
    import math

    import transformers

    import torch.distributed as dist

    from nnscaler_plugins.capture.experts import stacked_parameters
    from nnscaler_plugins.kernels.experts_module import register_template
    from nnscaler_plugins.kernels.expert_dispatch import expert_all_to_all

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K)
    module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    key = register_template(module)
    names = tuple(n for n, _ in stacked_parameters(module))
    torch.manual_seed(1 + rank)
    t = 12
    x = torch.randn(t, 16, requires_grad=True)
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(t)])
    ids[: t // 2, 0] = 0  # a crowded expert, so a capacity drops rows
    w = torch.rand(t, TOP_K, requires_grad=True)
    local = EXPERTS // world
    share = [p[rank * local:(rank + 1) * local].detach().clone().requires_grad_() for _, p in module.named_parameters()]
    out = expert_all_to_all(x, ids, w, *share, key=key, names=names, first_expert=rank * local, num_experts=EXPERTS,
                            capacity_factor=capacity_factor, group=dist.group.WORLD)
    out.square().sum().backward()
    keep = torch.ones(t * TOP_K, dtype=torch.bool)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * t * TOP_K / EXPERTS)
        flat = ids.reshape(-1)
        seen = torch.zeros(EXPERTS, dtype=torch.long)
        for i, e in enumerate(flat.tolist()):
            keep[i] = bool(seen[e] < cap)
            seen[e] += 1
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    ref = module(x2, ids, w2 * keep.view(t, TOP_K))
    ref.square().sum().backward()
    grads = [p.grad for p in share]  # rows from every rank reach this share: already the whole gradient
    problems = []
    if not torch.allclose(out, ref, rtol=1e-5, atol=1e-6):
        problems.append(f"output {(out - ref).abs().max():.3g}")
    for what, a, b in (("x", x.grad, x2.grad), ("weights", w.grad, w2.grad)):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            problems.append(f"grad {what} {(a - b).abs().max():.3g}")
    ref_grads = [p.grad.clone() for p in module.parameters()]
    for g in ref_grads:
        dist.all_reduce(g)  # the reference saw this rank's rows only; the share's gradient sums every rank's
    for g, r in zip(grads, ref_grads):
        if not torch.allclose(g, r[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-6):
            problems.append("expert weight grads")
    return problems, int((~keep).sum())


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_dispatch_kernel(workers2, capacity_factor):
    results = workers2.run(_kernel_against_module, capacity_factor)
    for problems, dropped in results:
        assert not problems, problems
        assert (dropped > 0) == (capacity_factor is not None), dropped


class _LoopExperts(torch.nn.Module):
    """A hand-written experts module in three layouts: "fused" (gate and up rows stacked, as HF),
    "transposed" (weights stored input-major), "interleaved" (gate and up rows alternating) and
    "biased" (a bias added after the down projection) and "normed" (the width normalized between the
    projections, which no cut of the width computes in pieces)."""

    def __init__(self, layout, experts=4, hidden=16, width=8):
        super().__init__()
        self.num_experts, self.layout = experts, layout
        e, h, i = experts, hidden, width
        transposed = layout == "transposed"
        self.gate_up = torch.nn.Parameter(torch.randn((e, h, 2 * i) if transposed else (e, 2 * i, h)) * 0.3)
        self.down = torch.nn.Parameter(torch.randn((e, i, h) if transposed else (e, h, i)) * 0.3)
        if layout == "biased":
            self.down_bias = torch.nn.Parameter(torch.randn(e, h) * 0.3)

    def forward(self, x, ids, weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(ids == e)
            gu = self.gate_up[e].t() if self.layout == "transposed" else self.gate_up[e]
            dn = self.down[e].t() if self.layout == "transposed" else self.down[e]
            y = torch.nn.functional.linear(x[rows], gu)
            gate, up = (y[:, ::2], y[:, 1::2]) if self.layout == "interleaved" else y.chunk(2, -1)
            act = torch.nn.functional.silu(gate) * up
            if self.layout == "normed":
                act = act / act.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
            y = torch.nn.functional.linear(act, dn)
            if self.layout == "biased":
                y = y + self.down_bias[e]
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        return out


class _TinyMoE(torch.nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.inp, self.router, self.experts = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4), _LoopExperts(layout)

    def forward(self, x):
        h = self.inp(x)
        weights, ids = torch.softmax(self.router(h), -1).topk(2, -1)
        return (self.experts(h, ids, weights) ** 2).mean()


@pytest.mark.parametrize("layout,found", [("fused", ((1, 2), (2, 1))), ("transposed", ((2, 2), (1, 1))),
                                          ("interleaved", ((1, 1), (2, 1))), ("biased", ((1, 2), (2, 1), None)),
                                          ("normed", None)])
def test_expert_width_found_by_running_the_module(layout, found):
    """Which weight dims hold each expert's width (and their fused sections) is found by running
    the module on slices; layouts whose slices do not add up are not split."""
    from nnscaler_plugins.rules.experts_intermediate import intermediate_dims
    from nnscaler_plugins.kernels.experts_module import register_template

    module = _LoopExperts(layout)
    params = list(module.named_parameters())
    key = register_template(module)
    dims = intermediate_dims(key, [n for n, _ in params], [tuple(p.shape) for _, p in params], 16, 2)
    assert (dims.dims if dims is not None else None) == found


def test_expert_tensor_parallel_refused_before_launch():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    with pytest.raises(PlanError, match="does not add up from slices of its width"):
        nns.plan(_TinyMoE("normed"), strategy="ep", world_size=2, ep=1, etp=2, example_inputs=(x,))
    plan = nns.plan(_TinyMoE("transposed"), strategy="ep", world_size=4, ep=2, etp=2, example_inputs=(x,))
    experts = [p for name, p in plan.ops.items() if dict(p.splits).get("f")]
    assert experts and dict(experts[0].splits) == {"t": 2, "f": 2}, plan.ops
    model, batch = mixtral()
    with pytest.raises(PlanError, match=r"etp=5 does not divide each expert's intermediate width \(48\)"):
        nns.plan(model, strategy="ep", world_size=5, ep=1, etp=5, example_inputs=batch)
    with pytest.raises(PlanError, match="etp='2': must be a positive integer"):
        nns.plan(model, strategy="ep", world_size=2, ep=1, etp="2", example_inputs=batch)
    with pytest.raises(PlanError, match="tp=4 must divide ep x etp = 2"):
        nns.plan(model, strategy="ep", world_size=4, ep=1, etp=2, tp=4, example_inputs=batch)
