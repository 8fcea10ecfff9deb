"""Mixture-of-experts layers captured as one op, so a plan can move tokens to their experts.

Why one op: what a MoE layer computes per (token, expert) row depends only on that row and its
expert's weights, but models write it in many forms (a Python loop over the experts that were hit,
grouped matmuls behind `histc`/`cumsum` offsets, a `ModuleList` of expert MLPs), all driven by
data-dependent routing, and the split sizes several of them read with `.tolist()` cannot be traced
at all. Seen as one op, the computation has a plain dimension rule (`rules/experts_op.py`) whose
expert split runs a dispatching kernel of `kernels/expert_dispatch.py`, and the data-dependent
sizes stay inside the op, a run-time matter.

What is recognized, by what the module does and not by its class (`capture/experts_probe.py`):

- an experts layout: every parameter stacked along one leading dim of `E` experts, or a
  `ModuleList` of `E` identical experts and no parameter of its own;
- called the *routed* way, `experts(tokens (T, H), ids (T, K), weights (T, K))` returning (T, H),
  for a stacked module whose `num_experts` is `E` (the `...Experts` modules of Mixtral, Qwen-MoE,
  DeepSeek-V3 and other transformers 5 models) -- recorded as `ExpertsCall`, and only when a
  strategy asks for it (`experts_as_one_op(model)`): other plans keep the expert ops as
  transformers wrote them (their grouped matmuls have rules of their own);
- called the *sorted* way, `experts(rows (N, H) sorted by expert, counts (E,) [, probs (N,)])`
  returning the N output rows (or a tuple holding them), as torchtitan's `GroupedExperts` and
  Megatron's `SequentialMLP`/`GroupedMLP` are -- recorded as `SortedExpertsCall` under every plan
  (`capture` always does it), since tracing it would meet the data-dependent split sizes.
  Which convention it takes (a probability per row or not, integer or `histc` counts, what it
  returns) is found by calling the module on made-up rows before capture.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Mapping, Optional

import torch

from nnscaler_plugins.capture.autograd_functions import opaque_call
from nnscaler_plugins.capture.experts_probe import ExpertsLayout, experts_layout, sorted_conventions
from nnscaler_plugins.kernels.experts_module import (
    ExpertsCall,
    SortedConvention,
    SortedExpertsCall,
    register_template,
    template_key,
)

#: What probing found per module configuration (template key): the sorted conventions by hidden size.
_PROBED: dict[str, dict[int, SortedConvention]] = {}


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


def sorted_call(forward: Any, layout: ExpertsLayout, conventions: dict[int, SortedConvention],
                args: tuple, kwargs: dict) -> Optional[tuple[SortedConvention, tuple]]:
    """The convention and (rows, counts, probs or None) when this call of the module's own `forward`
    is a sorted-experts call: floating rows (N, H), counts (E,) for the module's E experts, and
    (where the module takes them) one probability per row; None otherwise."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except TypeError:
        return None
    values = list(bound.arguments.values())
    if not 2 <= len(values) <= 3 or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    x, counts, *rest = values
    if x.ndim != 2 or not x.is_floating_point() or counts.ndim != 1 or counts.shape[0] != layout.experts:
        return None
    conv = conventions.get(int(x.shape[1]))
    if conv is None or conv.probs != bool(rest):
        return None
    probs = rest[0] if rest else None
    if probs is not None and (not probs.is_floating_point() or probs.shape[0] != x.shape[0] or probs.numel() != x.shape[0]):
        return None
    return conv, (x, counts, probs)


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module, routed: bool = True) -> Iterator[list[str]]:
    """While active, every experts module of `model` records one op when it is called (inside
    `capture`, which keeps such Functions whole): `SortedExpertsCall` for the sorted convention,
    and, with `routed`, `ExpertsCall` for the routed one. Yields the module paths that were found."""
    found: list[str] = []
    patched: list[torch.nn.Module] = []
    for path, module in model.named_modules():
        if "forward" in vars(module):
            continue
        layout = experts_layout(module)
        if layout is None:
            continue
        takes_routed = routed and stacked_parameters(module) is not None
        key = template_key(module)
        if key not in _PROBED:
            _PROBED[key] = sorted_conventions(module, layout)
        conventions = _PROBED[key]
        if not takes_routed and not conventions:
            continue
        register_template(module)
        names = tuple(n for n, _ in module.named_parameters())
        original = module.forward

        def forward(*args: Any, _orig=original, _mod=module, _key=key, _names=names, _layout=layout,
                    _convs=conventions, _routed=takes_routed, **kwargs: Any) -> Any:
            tensors = tuple(p for _, p in _mod.named_parameters())
            if _routed and is_experts_call(args, kwargs):
                x, ids, w = args
                return opaque_call(ExpertsCall, (x, ids, w, _key, _names) + tensors, {})
            call = sorted_call(_orig, _layout, _convs, args, kwargs)
            if call is None:
                return _orig(*args, **kwargs)
            conv, (x, counts, probs) = call
            register_template(_mod, conv)
            out = opaque_call(SortedExpertsCall, (x, counts, probs, _key, _names) + tensors, {})
            if conv.index is None:
                return out
            return tuple(out if i == conv.index else None for i in range(conv.length))

        module.forward = forward
        patched.append(module)
        found.append(path)
    try:
        yield found
    finally:
        for module in patched:
            del module.forward


def wants_experts_as_one_op(strategy_or_plan: Any, options: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether a strategy (attribute `experts_as_one_op`: True, or a function of the strategy's
    options, as megatron's, which splits experts only with ep= / etp=) or a plan it made (its knob
    `experts_as_one_op`) needs the experts captured as one op."""
    for holder in (strategy_or_plan, getattr(strategy_or_plan, "apply", None)):
        wants = getattr(holder, "experts_as_one_op", False)
        if callable(wants):
            wants = wants(dict(options or {}))
        if wants is True:
            return True
    return bool(getattr(getattr(strategy_or_plan, "knobs", None), "experts_as_one_op", False))
