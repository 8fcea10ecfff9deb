"""Grouped-query attention without copies of its keys and values.

Traced Hugging Face models that build their mask as a tensor (every model under torch.export) take
the path that repeats each key/value head for its group of query heads (`repeat_kv`: unsqueeze,
expand, reshape, one copy of K and one of V per layer) before `scaled_dot_product_attention`. Once
capture has folded that mask into `is_causal` (capture/causal_mask.py), eager PyTorch would have
called the attention with `enable_gqa=True` instead, which reads the heads in place. This pass
makes that rewrite on each device's statements, after the lowering: it reads only local shapes,
so it holds under any split of the heads (a device holding 2 of 4 key/value heads repeats those
2 for its 4 query heads, exactly what `enable_gqa` computes from them). Backward then sums each
group's key/value gradients inside the attention kernel instead of through the expand.

Only calls without a mask tensor are rewritten, as transformers itself decides (a masked call with
`enable_gqa` leaves the fused kernels on a GPU), and only where nothing else reads the copies.
The copies still appear in the captured graph, so the search prices them; they are views and one
memory-bound copy per layer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.lower.tp_overlap import stmt_reads

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _plain(s: Any, like: Any) -> bool:
    """An op statement that may go with `like` (the attention call): same recompute group and
    gradient mode, not co-sharded, serving no model output, running no collective."""
    return (s.kind == "op" and s.coshard is None and s.group_kwarg is None and s.output_of is None
            and s.recompute == like.recompute and s.grad_enabled == like.grad_enabled)


def _ints(xs: Any) -> Optional[list[int]]:
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        return None
    return list(xs)


def _repeat_source(stmts: list[Any], at: dict[str, int], readers: dict[str, list[int]], name: str, attn: Any,
                   keep: set[str]) -> Optional[tuple[str, list[int]]]:
    """(the un-repeated key/value, the statements of its repeat) when `name` is `repeat_kv` of a
    (batch, heads, seq, dim) tensor read only on its way to the attention call, else None."""
    chain: list[int] = []
    for target in (RESHAPES, (aten.expand.default,), (aten.unsqueeze.default,)):
        i = at.get(name)
        if i is None or name in keep or len(readers.get(name, ())) != 1:
            return None
        s = stmts[i]
        if s.target not in target or not _plain(s, attn) or len(s.out) != 1 or not s.args \
                or not isinstance(s.args[0], Ref):
            return None
        chain.append(i)
        name = s.args[0].name
    reshape, expand, unsqueeze = (stmts[i] for i in chain)
    size, grown = _ints(reshape.args[1] if len(reshape.args) > 1 else None), \
        _ints(expand.args[1] if len(expand.args) > 1 else None)
    dim = unsqueeze.args[1] if len(unsqueeze.args) > 1 else unsqueeze.kwargs.get("dim")
    if size is None or grown is None or len(grown) != 5 or len(size) != 4 or dim not in (2, -3):
        return None
    b, h, r, s, d = grown
    if min(b, h, s, d) < 1 or r < 2 or size != [b, h * r, s, d]:
        return None
    return name, chain


def fold_program(per_device: dict[tuple[int, int], list[Any]], keep: set[str]) -> dict[tuple[int, int], list[Any]]:
    """Every (device, stage) list with its key/value repeats folded into `enable_gqa` (see the
    module docstring); `keep`: values a stage returns, never removed."""
    return {key: fold(stmts, keep) for key, stmts in per_device.items()}


def fold(stmts: list[Any], keep: set[str]) -> list[Any]:
    """One device's statements of one stage with the repeats folded."""
    at: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, s in enumerate(stmts):
        for n in stmt_reads(s):
            readers.setdefault(n, []).append(i)
        for o in s.out:
            if o:
                at.setdefault(o, i)
    drop: set[int] = set()
    out = list(stmts)
    for i, s in enumerate(stmts):
        if s.kind != "op" or s.target is not SDPA or s.coshard is not None or len(s.args) < 3:
            continue
        mask = s.args[3] if len(s.args) > 3 else s.kwargs.get("attn_mask")
        if mask is not None or s.kwargs.get("enable_gqa") or len(s.args) > 6:
            continue
        k, v = s.args[1], s.args[2]
        if not (isinstance(k, Ref) and isinstance(v, Ref)) or k.name == v.name:
            continue
        found_k = _repeat_source(stmts, at, readers, k.name, s, keep)
        found_v = _repeat_source(stmts, at, readers, v.name, s, keep)
        if found_k is None or found_v is None:
            continue
        args = (s.args[0], Ref(found_k[0]), Ref(found_v[0])) + tuple(s.args[3:])
        out[i] = replace(s, args=args, kwargs={**s.kwargs, "enable_gqa": True})
        drop.update(found_k[1] + found_v[1])
    return [s for i, s in enumerate(out) if i not in drop]
