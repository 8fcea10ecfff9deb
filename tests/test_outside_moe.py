"""Mixture-of-experts layers written the grouped-GEMM way (tests/outside_moe.py: torchtitan's and
Megatron-Core's layouts, tokens sorted by expert, split sizes read with `.tolist()` inside the
experts module) capture with the experts as one op and train exactly like one process (SGD, fp32,
relative 1e-5) under dp, tp, zero3, a pipeline and ep/etp; ep finds them by what the module does;
what it cannot split is refused by name before launch, and data-dependent sizes outside an experts
module are refused with the model line and the ways out.

The default run trains a few representative plans; NNS_TEST_ALL_PLANS=1 runs the whole matrix.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import outside_moe
from sgd_check import sgd_equivalence

EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"

MODELS = {"titan": outside_moe.titan_moe_lm, "megatron": outside_moe.megatron_moe_lm,
          "megatron_grouped": lambda: outside_moe.megatron_moe_lm(grouped=True),
          "titan_softmax_after": lambda: outside_moe.titan_moe_lm(score_func="softmax", score_before_experts=False)}

# (model, strategy, options, dp): dp is the number of data-parallel replicas the batch is cut into.
# titan under dp guards the counts of each replica's own rows (never made whole across replicas).
DEFAULT_2 = [("titan", "dp", {}, 2), ("titan", "ep", {"ep": 2}, 1), ("megatron", "zero3", {}, 2)]
ALL_2 = [(m, s, o, dp) for m in MODELS
         for s, o, dp in (("dp", {}, 2), ("tp", {}, 1), ("zero3", {}, 2), ("gpipe", {"pp": 2, "micro_batches": 2}, 1))]
ALL_2 += [("titan", "ep", {"ep": 1, "etp": 2}, 1), ("titan_softmax_after", "ep", {"ep": 2}, 1),
          ("megatron_grouped", "ep", {"ep": 2}, 1), ("megatron_grouped", "ep", {"ep": 1, "etp": 2}, 1)]
DEFAULT_4 = [("titan", "ep", {"ep": 2, "etp": 2}, 1)]
ALL_4 = [("titan", "ep", {"ep": 2, "dp": 2}, 2), ("titan", "ep", {"ep": 4}, 1), ("titan", "ep", {"ep": 2, "pp": 2}, 1),
         ("titan", "ep", {"ep": 2, "tp": 2}, 1), ("megatron", "ep", {"ep": 1, "dp": 4}, 4),
         ("titan", "ep", {"ep": 2, "dp": 2, "zero": 3}, 2), ("megatron_grouped", "ep", {"ep": 2, "etp": 2}, 1),
         ("megatron_grouped", "ep", {"ep": 2, "dp": 2}, 2)]


def _equivalence(rank, world, name, strategy, options, dp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sgd_equivalence(rank, world, MODELS[name], strategy, options, dp, what=f"{name} {strategy} {options}")


@pytest.mark.parametrize("name,strategy,options,dp", ALL_2 if EVERY else DEFAULT_2)
def test_trains_like_one_process_on_2(workers2, name, strategy, options, dp):
    problems = workers2.run(_equivalence, name, strategy, options, dp)
    assert not any(problems), problems


@pytest.mark.parametrize("name,strategy,options,dp", DEFAULT_4 + (ALL_4 if EVERY else []))
def test_trains_like_one_process_on_4(workers4, name, strategy, options, dp):
    problems = workers4.run(_equivalence, name, strategy, options, dp)
    assert not any(problems), problems


def _memory_and_collectives(rank, world):
    """Expert weights held here and the all-to-alls of one forward and backward under ep=world."""
    from collective_counts import all_to_alls

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = outside_moe.titan_moe_lm()
    total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, batch, plan="ep", ep=world, cache_dir="/tmp/nns_test_cache")
    with all_to_alls() as calls:
        loss = pm(**batch)
        forward = calls["all"]
        loss.backward()
        backward = calls["all"] - forward
    held = sum(p.numel() for n, p in pm.named_parameters() if "experts" in n and "shared" not in n)
    source = [line for line in pm.generated_source().splitlines() if "sorted_expert_all_to_all(" in line]
    return dict(total=total, held=held, forward=forward, backward=backward, source=source)


def test_ep_holds_a_share_of_the_experts_and_moves_rows_by_all_to_all(workers2):
    """Each device holds half of every layer's experts; each MoE layer moves its rows by two
    all-to-alls forward (dispatch, combine) and two backward, readable in the generated code."""
    layers = 2
    for r in workers2.run(_memory_and_collectives):
        assert r["held"] == r["total"] // 2, r
        assert r["forward"] == 2 * layers and r["backward"] == 2 * layers, r
        assert len(r["source"]) >= layers and all("group=" in line for line in r["source"]), r["source"]


def _sorted_kernel(rank, world, probs):
    """The dispatch kernel on this rank's chunk of the sorted rows and share of the experts against
    the whole module on every row, forward and backward."""
    import torch.distributed as dist

    from nnscaler_plugins.kernels.expert_dispatch import sorted_expert_all_to_all
    from nnscaler_plugins.capture.experts_probe import experts_layout, sorted_conventions
    from nnscaler_plugins.kernels.experts_module import register_template

    torch.manual_seed(0)
    experts = 4
    module = (outside_moe.GroupedMLP(experts, 16, 8) if probs else
              outside_moe.GroupedExperts(16, 8, experts, use_grouped_mm=False))
    names = tuple(n for n, _ in module.named_parameters())
    key = register_template(module, sorted_conventions(module, experts_layout(module))[16])
    counts = torch.tensor([3, 0, 5, 4])  # an expert with no rows; chunks cut inside experts' rows
    x = torch.randn(12, 16)
    p = torch.rand(12) if probs else None
    whole = [w.detach().clone().requires_grad_() for w in module.parameters()]
    xw = x.clone().requires_grad_()
    pw = p.clone().requires_grad_() if probs else None
    rows = 12 // world
    share = experts // world
    xs = x[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    ps = p[rank * rows:(rank + 1) * rows].clone().requires_grad_() if probs else None
    ws = [w.detach()[rank * share:(rank + 1) * share].clone().requires_grad_() for w in module.parameters()]
    out = sorted_expert_all_to_all(xs, counts, ps, *ws, key=key, names=names, first_row=rank * rows,
                                   first_expert=rank * share, num_experts=experts, group=dist.group.WORLD)
    upstream = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    (out * upstream[rank * rows:(rank + 1) * rows]).sum().backward()
    ref = torch.func.functional_call(module, dict(zip(names, whole)), (xw, counts) + ((pw,) if probs else ()))
    ref = ref[0] if isinstance(ref, tuple) else ref
    (ref * upstream).sum().backward()
    problems = []
    sl = slice(rank * rows, (rank + 1) * rows)
    if not torch.allclose(out, ref[sl], rtol=1e-5, atol=1e-6):
        problems.append(f"rank {rank}: rows differ by {(out - ref[sl]).abs().max():.3g}")
    if not torch.allclose(xs.grad, xw.grad[sl], rtol=1e-5, atol=1e-6):
        problems.append(f"rank {rank}: grad of the rows differs")
    if probs and not torch.allclose(ps.grad, pw.grad[sl], rtol=1e-5, atol=1e-6):
        problems.append(f"rank {rank}: grad of the probabilities differs")
    for w, g in zip(ws, whole):
        if not torch.allclose(w.grad, g.grad[rank * share:(rank + 1) * share], rtol=1e-5, atol=1e-6):
            problems.append(f"rank {rank}: expert weight grads differ")
    return problems


@pytest.mark.parametrize("probs", [False, True])
def test_sorted_dispatch_kernel(workers2, probs):
    problems = workers2.run(_sorted_kernel, probs)
    assert not any(problems), problems


def test_experts_width_split_matches_the_whole_op():
    """The in-process property check of the sorted-experts rule: each split it offers that needs no
    process group (each expert's width, alone and nested) computed piece by piece equals the op."""
    from test_rules import call_of, check_call

    from nnscaler_plugins.capture.autograd_functions import FunctionTarget
    from nnscaler_plugins.capture.graph import Ref
    from nnscaler_plugins.capture.experts_probe import experts_layout, sorted_conventions
    from nnscaler_plugins.kernels.experts_module import SortedExpertsCall, register_template
    from nnscaler_plugins.rules import signature_of

    torch.manual_seed(0)
    for module, probs in ((outside_moe.GroupedExperts(16, 8, 4, use_grouped_mm=False), False),
                          (outside_moe.GroupedMLP(4, 16, 8), True)):
        names = tuple(n for n, _ in module.named_parameters())
        convention = sorted_conventions(module, experts_layout(module))[16]
        assert convention.probs == probs and (convention.index is None) == (not probs), convention
        key = register_template(module, convention)
        tensors = {"x": torch.randn(10, 16), "c": torch.tensor([2, 0, 5, 3]),
                   **({"p": torch.rand(10)} if probs else {}),
                   **{f"w{i}": p.detach().clone() for i, p in enumerate(module.parameters())}}
        args = (Ref("x"), Ref("c"), Ref("p") if probs else None, key, names,
                *(Ref(f"w{i}") for i in range(len(names))))
        call = call_of(FunctionTarget(SortedExpertsCall), args, {}, tensors)
        sig = signature_of(call)
        assert {"t", "f"} <= set(sig.splittable()), sig
        problems, ran = check_call(call, tensors, f"{type(module).__name__}")
        assert ran and not problems, problems


def test_what_ep_cannot_split_is_refused_by_name():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, batch = outside_moe.megatron_moe_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PlanError, match=r"ep=2 .*ModuleList.*stack them as parameters of shape \(experts, \.\.\.\)"
                                           r".*use ep=1") as info:
            nns.plan(model, strategy="ep", world_size=2, ep=2, example_inputs=batch)
    assert "outside_moe.py" in str(info.value), str(info.value)  # the line that calls the experts
    from nnscaler_plugins.lower import lower

    model, batch = outside_moe.titan_moe_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = nns.capture(model, kwargs=batch)
        with pytest.raises(PlanError, match="capacity_factor.*sorted by expert.*capacity_factor=None"):
            lower(graph, nns.plan(graph, strategy="ep", world_size=2, ep=2, capacity_factor=1.0))


class _SplitSizesInTheLayer(torch.nn.Module):
    """A MoE layer that reads its split sizes itself, with no experts module to keep them in."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        order = torch.argsort(ids, stable=True)
        sizes = torch.bincount(ids, minlength=4).tolist()  # SPLIT-SIZES-LINE
        rows = torch.split(x[order], sizes)
        out = torch.cat([r @ self.w[e] for e, r in enumerate(rows)])
        return out[torch.argsort(order)].square().mean()


def _permute_without_check(tokens, routing_map):
    indices = torch.arange(tokens.shape[0]).unsqueeze(0).expand(routing_map.shape[1], -1)
    return tokens.index_select(0, indices.masked_select(routing_map.T.contiguous()))


def test_data_dependent_sizes_outside_an_experts_module_are_refused_with_the_line_and_the_ways_out():
    from nnscaler_plugins.capture.tracing import CaptureError, capture

    with pytest.raises(CaptureError) as info:
        capture(_SplitSizesInTheLayer(), (torch.randn(8, 16),))
    text = str(info.value)
    assert "SPLIT-SIZES-LINE" in text and "test_outside_moe.py" in text, text
    assert "experts(rows sorted by expert, counts per expert)" in text, text

    class Permutes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(16, 4)

        def forward(self, x):
            top = self.router(x).topk(2, -1).indices
            routing_map = torch.zeros(x.shape[0], 4, dtype=torch.bool).scatter(1, top, True)
            return _permute_without_check(x, routing_map).sum()  # MASKED-SELECT-LINE (torch.export names the forward's line)

    with pytest.raises(CaptureError) as info:
        capture(Permutes(), (torch.randn(8, 16),))
    text = str(info.value)
    assert "MASKED-SELECT-LINE" in text and "torch._check(t.shape[0] == n)" in text, text


def test_a_dense_block_is_not_taken_for_stacked_experts():
    """Stacked experts are (E, in, out) matrices. An attention block's four square projections share
    their first dim too, but they are 2-D: not an experts layout, so capture never runs the block on
    made-up rows to find out (which took seconds a layer at a 7B model's sizes)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    from nnscaler_plugins.capture.experts_probe import experts_layout

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
    with torch.device("meta"):
        assert experts_layout(LlamaAttention(cfg, 0)) is None
        assert experts_layout(LlamaMLP(cfg)) is None
    layout = experts_layout(_Stacked3D())  # the same test still finds stacked (E, in, out) experts
    assert layout is not None and layout.kind == "stacked" and layout.experts == 4


class _Stacked3D(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(4, 8, 16))
        self.down = torch.nn.Parameter(torch.randn(4, 16, 8))
