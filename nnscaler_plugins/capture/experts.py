"""Mixture-of-experts layers captured as one op, so a plan can move tokens to their experts.

Why one op: what a MoE layer computes per token is `sum_k w[t, k] * expert_{i[t, k]}(x[t])`, but
transformers writes it in several forms (a Python loop over the experts that were hit, grouped
matmuls behind `histc`/`index_put`, batched matmuls), all driven by data-dependent routing. None of
those forms can be split so that each device holds only its experts *and* sees only the tokens
routed to them: that needs the tokens moved by all-to-all, with sizes known at run time. Seen as one
op `experts(x, top_k_index, top_k_weights, *stacked weights)`, the same computation has a plain
dimension rule (`rules/expert_parallel.py`) whose expert split runs the dispatching kernel of
`runtime/expert_dispatch.py`.

What is recognized, by structure and not by class name: a module whose parameters are all stacked
along a leading dim of `E` experts (`E` equal to its `num_experts` attribute), called with a token
matrix `(T, H)`, integer expert ids `(T, K)` and routing weights `(T, K)`, returning `(T, H)`. This
is the `...Experts` module of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and other transformers 5
models, whichever experts implementation the config selects.

Only a strategy that asks for it (`experts_as_one_op`) captures this way; other plans keep the
expert ops as transformers wrote them (their grouped matmuls have rules of their own).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from typing import Any, Iterator, Optional

import torch
from torch.func import functional_call

from nnscaler_plugins.capture.autograd_functions import opaque_call

#: Experts modules by key, so the op (and its pieces) can run the module's own forward with other
#: weights. The key is the module class and a digest of its configuration: the same on every rank
#: and in every process that captures the same model.
_TEMPLATES: dict[str, torch.nn.Module] = {}


def stacked_parameters(module: torch.nn.Module) -> Optional[list[tuple[str, torch.nn.Parameter]]]:
    """The module's parameters when they are all stacked along one leading expert dim equal to its
    `num_experts`, else None."""
    e = getattr(module, "num_experts", None)
    params = list(module.named_parameters())
    if not isinstance(e, int) or e < 1 or not params:
        return None
    if any(p.ndim < 2 or p.shape[0] != e for _, p in params):
        return None
    return params


def is_experts_call(args: tuple, kwargs: dict) -> bool:
    """The call pattern of a stacked-experts module: (tokens (T, H), ids (T, K), weights (T, K))."""
    if kwargs or len(args) != 3 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    x, ids, w = args
    return (x.ndim == 2 and ids.ndim == 2 and w.ndim == 2 and x.is_floating_point()
            and not ids.is_floating_point() and w.is_floating_point()
            and ids.shape == w.shape and ids.shape[0] == x.shape[0])


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


def register_template(module: torch.nn.Module) -> str:
    key = template_key(module)
    _TEMPLATES.setdefault(key, module)
    return key


def template(key: str, num_experts: Optional[int] = None) -> torch.nn.Module:
    """The experts module registered under `key`; with `num_experts`, a shallow copy that believes
    it holds that many experts (a device's share), its weights given at each call."""
    try:
        whole = _TEMPLATES[key]
    except KeyError:
        raise RuntimeError(f"experts module {key!r} is not known in this process: the model must be captured "
                           "here (nns.parallelize does) before the generated code runs") from None
    if num_experts is None or num_experts == whole.num_experts:
        return whole
    local = copy.copy(whole)
    local._parameters = dict(whole._parameters)
    local._modules = dict(whole._modules)
    local.num_experts = num_experts
    return local


def run_experts(key: str, names: tuple[str, ...], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The module's own forward on these weights (a share of the experts when they are fewer)."""
    module = template(key, params[0].shape[0] if params else None)
    return functional_call(module, dict(zip(names, params)), (x, ids, weights), strict=True)


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


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[list[str]]:
    """While active, every stacked-experts module of `model` records one `ExpertsCall` op when it is
    called the experts way (inside `capture`, which keeps such Functions whole). Yields the module
    paths that were found."""
    found: list[str] = []
    patched: list[torch.nn.Module] = []
    for path, module in model.named_modules():
        params = stacked_parameters(module)
        if params is None or "forward" in vars(module):
            continue
        names = tuple(n for n, _ in params)
        key = register_template(module)
        original = module.forward

        def forward(*args: Any, _orig=original, _mod=module, _key=key, _names=names, **kwargs: Any) -> Any:
            if not is_experts_call(args, kwargs):
                return _orig(*args, **kwargs)
            x, ids, w = args
            tensors = tuple(p for _, p in _mod.named_parameters())
            return opaque_call(ExpertsCall, (x, ids, w, _key, _names) + tensors, {})

        module.forward = forward
        patched.append(module)
        found.append(path)
    try:
        yield found
    finally:
        for module in patched:
            del module.forward


def wants_experts_as_one_op(strategy_or_plan: Any) -> bool:
    """Whether a strategy (attribute `experts_as_one_op`) or a plan it made (recorded in its
    options) needs the experts captured as one op."""
    if getattr(strategy_or_plan, "experts_as_one_op", False) or \
            getattr(getattr(strategy_or_plan, "apply", None), "experts_as_one_op", False):
        return True
    options = getattr(strategy_or_plan, "options", None)
    return isinstance(options, dict) and bool(options.get("experts_as_one_op", False))
