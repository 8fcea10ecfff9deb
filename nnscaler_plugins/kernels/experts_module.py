"""An experts module run with weights given at the call: the op a captured MoE layer becomes.

`capture/experts.py` records each stacked-experts module as one `ExpertsCall`; generated code runs
it whole, or, split along experts, `expert_dispatch.expert_all_to_all` runs the same module's
forward on a device's share of the experts. Both find the module by a key that names its class and
configuration, registered when the model is captured in this process.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Optional

import torch
from torch.func import functional_call

#: Experts modules by key, so the op (and its pieces) can run the module's own forward with other
#: weights. The key is the module class and a digest of its configuration: the same on every rank
#: and in every process that captures the same model.
_TEMPLATES: dict[str, torch.nn.Module] = {}


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
