"""An experts module run with weights given at the call: the op a captured MoE layer becomes.

`capture/experts.py` records each experts module as one op, in the calling convention the model
uses:

- routed (`ExpertsCall`): `experts(tokens (T, H), expert ids (T, K), routing weights (T, K))`, the
  transformers form, returning each token's weighted sum over its K experts;
- sorted (`SortedExpertsCall`): `experts(rows sorted by expert (N, H), rows per expert (E,)
  [, probability per row])`, the torchtitan and Megatron form, returning one output row per input
  row (the module reads the split sizes from the counts itself, `.tolist()` and all).

Generated code runs the op whole, or, split along experts, a kernel of `expert_dispatch` runs the
same module's forward on a device's share of the experts. Both find the module by a key that names
its class and configuration, registered when the model is captured in this process (with, for the
sorted form, how the module takes its arguments: `SortedConvention`).
"""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.func import functional_call

#: Experts modules by key, so the op (and its pieces) can run the module's own forward with other
#: weights. The key is the module class and a digest of its configuration: the same on every rank
#: and in every process that captures the same model.
_TEMPLATES: dict[str, torch.nn.Module] = {}


@dataclass(frozen=True)
class SortedConvention:
    """How a sorted-experts module is called and what it returns (found by running it, see
    `capture/experts_probe.py`): whether it takes a probability per row as a third argument, the
    dtype of its counts (`histc` counts are floating), and where its output rows are (`index`: the
    position in the tuple it returns, None when it returns the tensor itself; `length`: the tuple's)."""

    experts: int
    probs: bool = False
    counts_dtype: torch.dtype = torch.int64
    index: Optional[int] = None
    length: int = 1


#: Sorted-experts modules by key: how each is called (see SortedConvention).
_SORTED: dict[str, SortedConvention] = {}


def template_key(module: torch.nn.Module) -> str:
    """Class and configuration digest of an experts module (its weights excluded)."""
    cfg = getattr(module, "config", None)
    described: Any
    if cfg is not None and hasattr(cfg, "to_dict"):
        described = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}
    else:
        described = {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str, bool))}
    described["__attrs__"] = {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str, bool))}
    described["__act__"] = sorted(type(m).__name__ for m in module.modules())
    digest = hashlib.sha1(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{type(module).__module__}.{type(module).__qualname__}#{digest}"


def register_template(module: torch.nn.Module, sorted_call: Optional[SortedConvention] = None) -> str:
    """Registers the module under its key (and, for a sorted-experts module, how it is called)."""
    key = template_key(module)
    _TEMPLATES.setdefault(key, module)
    if sorted_call is not None:
        _SORTED[key] = sorted_call
    return key


def sorted_convention(key: str) -> Optional[SortedConvention]:
    """How the sorted-experts module under `key` is called; None for a routed one."""
    return _SORTED.get(key)


def template(key: str, num_experts: Optional[int] = None) -> torch.nn.Module:
    """The experts module registered under `key`; with `num_experts`, a shallow copy that believes
    it holds that many experts (a device's share), its weights given at each call."""
    try:
        whole = _TEMPLATES[key]
    except KeyError:
        raise RuntimeError(f"experts module {key!r} is not known in this process: the model must be captured "
                           "here (nns.parallelize does) before the generated code runs") from None
    if num_experts is None or num_experts == getattr(whole, "num_experts", None):
        return whole
    local = copy.copy(whole)
    local._parameters = dict(whole._parameters)
    local._modules = dict(whole._modules)
    local.num_experts = num_experts
    return local


def run_experts(key: str, names: tuple[str, ...], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The module's own forward on these weights (a share of the experts when they are fewer), called
    the routed way. A sorted-experts module is called on the (token, choice) rows sorted by expert
    and its rows are put back and summed per token: weighted by `weights` when the module takes no
    probabilities, else with `weights` given to it as each row's probability."""
    conv = sorted_convention(key)
    if conv is not None:
        return _routed_through_sorted(key, names, conv, x, ids, weights, params)
    module = template(key, params[0].shape[0] if params else None)
    return functional_call(module, dict(zip(names, params)), (x, ids, weights), strict=True)


def run_sorted_experts(key: str, names: tuple[str, ...], x: torch.Tensor, counts: torch.Tensor,
                       probs: Optional[torch.Tensor], params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The sorted-experts module's own forward on these weights: rows sorted by expert, `counts`
    rows per expert (as many experts as `counts` has entries); its output rows."""
    conv = _SORTED[key]
    n = int(counts.shape[0])
    module = template(key, None if n == conv.experts else n)
    args = (x, counts.to(conv.counts_dtype)) + ((probs,) if conv.probs else ())
    out = functional_call(module, dict(zip(names, params)), args, strict=True)
    return out if conv.index is None else out[conv.index]


def _routed_through_sorted(key: str, names: tuple[str, ...], conv: SortedConvention, x: torch.Tensor,
                           ids: torch.Tensor, weights: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    t, k = ids.shape
    experts = int(params[0].shape[0]) if params else int(ids.max()) + 1
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    w = weights.reshape(-1)[order]
    y = run_sorted_experts(key, names, x[order // k], counts, w if conv.probs else None, params)
    rows = y[torch.argsort(order)].view(t, k, -1)
    if conv.probs:
        return rows.sum(1)
    return (rows * weights.unsqueeze(-1).to(rows.dtype)).sum(1)


class ExpertsCall(torch.autograd.Function):
    """The whole experts computation as one op: `ExpertsCall.apply(x, ids, weights, key, names, *params)`.

    Forward runs the module's forward without recording; backward recomputes it with autograd
    (one more expert pass), which gives exactly the module's gradients. Plans that split the
    experts run `runtime.expert_dispatch.expert_all_to_all` instead.
    """

    @staticmethod
    def forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, key: str, names: tuple,
                *params: torch.Tensor) -> torch.Tensor:
        if torch._subclasses.fake_tensor.is_fake(x) or x.device.type == "meta":
            return x.new_empty(x.shape)  # capture only needs the shape
        with torch.no_grad():
            return run_experts(key, tuple(names), x, ids, weights, params)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, ids, weights, key, names, *params = inputs
        ctx.key, ctx.names = key, tuple(names)
        ctx.save_for_backward(x, ids, weights, *params)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, ids, weights, *params = ctx.saved_tensors
        want = [x, weights, *params]
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], *ctx.needs_input_grad[5:]]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip(want, needs)]
            out = run_experts(ctx.key, ctx.names, leaves[0], ids, leaves[1], tuple(leaves[2:]))
            tracked = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, tracked, grad, allow_unused=True) if tracked else ())
        g = [next(grads) if t.requires_grad else None for t in leaves]
        return (g[0], None, g[1], None, None, *g[2:])


class SortedExpertsCall(torch.autograd.Function):
    """A sorted-experts module as one op: `SortedExpertsCall.apply(x, counts, probs, key, names, *params)`,
    rows `x` sorted by expert, `counts` rows per expert, `probs` one per row or None.

    The split sizes the module reads from `counts` (`.tolist()`) are data: inside this op they stay
    a run-time matter, so capture needs no symbolic sizes. Forward runs the module without
    recording; backward recomputes it with autograd (one more expert pass), which gives exactly the
    module's gradients. A plan that splits the experts runs `expert_dispatch.sorted_expert_all_to_all`.
    """

    @staticmethod
    def forward(x: torch.Tensor, counts: torch.Tensor, probs: Optional[torch.Tensor], key: str, names: tuple,
                *params: torch.Tensor) -> torch.Tensor:
        if torch._subclasses.fake_tensor.is_fake(x) or x.device.type == "meta":
            return x.new_empty(x.shape)  # capture only needs the shape
        with torch.no_grad():
            return run_sorted_experts(key, tuple(names), x, counts, probs, params)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, counts, probs, key, names, *params = inputs
        ctx.key, ctx.names, ctx.has_probs = key, tuple(names), probs is not None
        ctx.save_for_backward(x, counts, *((probs,) if probs is not None else ()), *params)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved = list(ctx.saved_tensors)
        x, counts = saved[0], saved[1]
        probs = saved[2] if ctx.has_probs else None
        params = saved[3:] if ctx.has_probs else saved[2:]
        want = [x, probs, *params]
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], *ctx.needs_input_grad[5:]]
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip(want, needs)]
            out = run_sorted_experts(ctx.key, ctx.names, leaves[0], counts, leaves[1], tuple(leaves[2:]))
            tracked = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, tracked, grad, allow_unused=True) if tracked else ())
        g = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
        return (g[0], None, g[1], None, None, *g[2:])
