"""Turn attention masks that are plainly causal back into `is_causal=True` at capture.

Under tracing, Hugging Face models cannot take their eager shortcut (no mask, `is_causal=True`)
and build the causal mask as a tensor instead: a chain of aranges, comparisons and an expand to
(batch, 1, L, S). Kept as is, every attention call then reads an L x S mask and the fused kernels
run the masked variant, which on a GPU costs about twice the causal one (GPT-2 small on an H100:
the attention kernels took 1.8x as long as eager's). When the mask depends on no input, parameter
or buffer, its value is known at capture: it is computed here, on the CPU, and where it equals the
lower triangle the call gets `is_causal=True` and no mask. The mask's producers then die and are
removed. Masks that depend on data (padding, packed sequences given by the caller) stay as they are.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# Values larger than this are not computed at capture (a huge batch times L x S); the mask stays.
_MAX_ELEMENTS = 1 << 25


class _NotConstant(Exception):
    pass


def fold_causal_masks(ep: "torch.export.ExportedProgram") -> int:
    """Rewrite constant causal masks of `ep`'s attention calls in place; returns how many."""
    graph = ep.graph
    constants = _constant_placeholders(ep)
    memo: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if not isinstance(mask, torch.fx.Node):
            continue
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        already_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if already_causal:
            continue
        L, S = _shape(q)[-2], _shape(k)[-2]
        if L != S:  # sdpa's is_causal is top-left aligned; only the square case is the same mask
            continue
        value = _evaluate(mask, constants, memo)
        if value is None or not _is_causal(value, L):
            continue
        kwargs = {key: val for key, val in node.kwargs.items() if key not in ("attn_mask", "dropout_p", "is_causal")}
        kwargs.update(dropout_p=dropout, is_causal=True)
        node.args = (q, k, v)
        node.kwargs = kwargs
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return folded


def _shape(node: Any) -> tuple:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _constant_placeholders(ep: "torch.export.ExportedProgram") -> dict[str, torch.Tensor]:
    """Placeholder name -> value, for lifted tensor constants only (not inputs, parameters or buffers)."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR:
            value = ep.constants.get(spec.target)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                out[spec.arg.name] = value.detach().cpu()
    return out


def _evaluate(node: torch.fx.Node, constants: dict[str, torch.Tensor], memo: dict) -> Optional[torch.Tensor]:
    try:
        value = _value(node, constants, memo)
    except _NotConstant:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _value(node: torch.fx.Node, constants: dict[str, torch.Tensor], memo: dict) -> Any:
    if node in memo:
        if memo[node] is _NotConstant:
            raise _NotConstant
        return memo[node]
    try:
        memo[node] = _compute(node, constants, memo)
    except _NotConstant:
        memo[node] = _NotConstant
        raise
    return memo[node]


def _compute(node: torch.fx.Node, constants: dict[str, torch.Tensor], memo: dict) -> Any:
    if node.op == "placeholder":
        if node.name in constants:
            return constants[node.name]
        raise _NotConstant
    if node.op != "call_function" or not isinstance(node.target, (torch._ops.OpOverload, type(len))):
        raise _NotConstant
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.numel() > _MAX_ELEMENTS:
        raise _NotConstant
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        raise _NotConstant
    if isinstance(node.target, torch._ops.OpOverload) and "rand" in node.target._schema.name:
        raise _NotConstant

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return _value(a, constants, memo)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    args = pytree.tree_map(arg, node.args)
    kwargs = pytree.tree_map(arg, dict(node.kwargs))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    kwargs.pop("pin_memory", None)
    try:
        return node.target(*args, **kwargs)
    except Exception:  # anything odd (symbolic sizes, unusual ops): keep the mask
        raise _NotConstant from None


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """True when the mask keeps exactly the lower triangle in every (batch, head) slice."""
    if mask.dim() < 2 or mask.shape[-2:] != (length, length):
        return False
    tril = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    if not mask.is_floating_point():
        return False
    # additive mask: 0 where kept, -inf (or the dtype's lowest value) where dropped
    low = torch.finfo(mask.dtype).min
    kept = mask == 0
    dropped = (mask == float("-inf")) | (mask <= low / 2)
    return bool((kept == tril).all()) and bool((dropped == ~tril).all())
