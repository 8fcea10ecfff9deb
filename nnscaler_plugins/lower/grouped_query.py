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
The copies still appear in the captured graph; `graph_repeats` finds the same ones there, so the
search prices them as what they become (views of the un-repeated keys and values: no copy, and the
attention keeps the un-repeated tensors for its backward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

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


def _repeat_chain(producer: Callable[[str], Any], readers: Callable[[str], int], name: str,
                  ok: Callable[[Any], bool]) -> Optional[tuple[str, list[Any]]]:
    """(the un-repeated key/value, the reshape, expand and unsqueeze making its repeat) when `name`
    is `repeat_kv` of a (batch, heads, seq, dim) tensor read only on its way to the attention call,
    else None. `producer(name)`: the statement or op that made a value (None: an input);
    `readers(name)`: how many read it; `ok`: what else each step must satisfy."""
    chain: list[Any] = []
    for target in (RESHAPES, (aten.expand.default,), (aten.unsqueeze.default,)):
        s = producer(name)
        if s is None or readers(name) != 1:
            return None
        if s.target not in target or not ok(s) or not s.args or not isinstance(s.args[0], Ref):
            return None
        chain.append(s)
        name = s.args[0].name
    reshape, expand, unsqueeze = chain
    size, grown = _ints(reshape.args[1] if len(reshape.args) > 1 else None), \
        _ints(expand.args[1] if len(expand.args) > 1 else None)
    dim = unsqueeze.args[1] if len(unsqueeze.args) > 1 else unsqueeze.kwargs.get("dim")
    if size is None or grown is None or len(grown) != 5 or len(size) != 4 or dim not in (2, -3):
        return None
    b, h, r, s_, d = grown
    if min(b, h, s_, d) < 1 or r < 2 or size != [b, h * r, s_, d]:
        return None
    return name, chain


def _foldable_call(s: Any) -> bool:
    """An attention call the rewrite applies to: no mask tensor, no `enable_gqa` yet, distinct key
    and value tensors."""
    if s.target is not SDPA or len(s.args) < 3:
        return False
    mask = s.args[3] if len(s.args) > 3 else s.kwargs.get("attn_mask")
    if mask is not None or s.kwargs.get("enable_gqa") or len(s.args) > 6:
        return False
    k, v = s.args[1], s.args[2]
    return isinstance(k, Ref) and isinstance(v, Ref) and k.name != v.name


def graph_repeats(graph: Any) -> dict[str, str]:
    """The captured graph's key/value repeats the lowering folds, as {op name of each step of a
    repeat: the un-repeated value}: what the search prices as views."""
    made: dict[str, Any] = {}
    count: dict[str, int] = {}
    for op in graph.ops:
        for n in op.inputs:
            count[n] = count.get(n, 0) + 1
        for o in op.outputs:
            if o:
                made.setdefault(o, op)
    for o in graph.outputs:
        if o is not None:
            count[o] = count.get(o, 0) + 1  # a returned copy is kept
    out: dict[str, str] = {}
    for op in graph.ops:
        if not _foldable_call(op):
            continue
        found = [_repeat_chain(made.get, lambda n: count.get(n, 0), ref.name,
                               lambda s: len([o for o in s.outputs if o]) == 1) for ref in op.args[1:3]]
        if all(f is not None for f in found):
            for source, chain in found:
                out.update({step.name: source for step in chain})
    return out


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
    index = {id(s): i for i, s in enumerate(stmts)}

    def producer(name: str) -> Any:
        i = at.get(name)
        return None if i is None or name in keep else stmts[i]

    for i, s in enumerate(stmts):
        if s.kind != "op" or s.coshard is not None or not _foldable_call(s):
            continue
        found = [_repeat_chain(producer, lambda n: len(readers.get(n, ())), ref.name,
                               lambda t: _plain(t, s) and len(t.out) == 1) for ref in s.args[1:3]]
        if any(f is None for f in found):
            continue
        (k_src, k_chain), (v_src, v_chain) = found
        args = (s.args[0], Ref(k_src), Ref(v_src)) + tuple(s.args[3:])
        out[i] = replace(s, args=args, kwargs={**s.kwargs, "enable_gqa": True})
        drop.update(index[id(t)] for t in k_chain + v_chain)
    return [s for i, s in enumerate(out) if i not in drop]
