"""The experts' all-to-alls beside compute that needs neither their inputs nor their output.

An experts layer split along experts runs `expert_dispatch.expert_all_to_all`: two all-to-alls
(dispatch, combine) with the local experts between them. A model with a shared expert (Qwen2-MoE,
DeepSeek-V3, GLM-4-MoE) computes it beside the routed ones from the same tokens, so nothing orders
it before or after them. This pass runs such a layer in three calls (`expert_dispatch_start`,
`_compute`, `_finish`) and places the independent statements between them: those before the layer
that its inputs do not depend on go after the start (beside the dispatch), those after it, up to
the first that reads its output, stay before the finish (beside the combine), as Megatron-Core's
shared-expert overlap does. Only statements that communicate nothing move, and never past one that
does (collectives keep their order); the rewrite is made only where a matmul lands beside an
all-to-all, and only where every device of the layer's group makes it alike.

Backward runs each all-to-all when autograd reaches it (the reverse exchanges are not overlapped).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.kernels import expert_dispatch
from nnscaler_plugins.lower.tp_overlap import MATMULS, stmt_reads


def _communicates(s: Any) -> bool:
    """Whether a statement runs or waits for a collective (forward or backward)."""
    return (s.kind in ("reshard", "grad_sum") or s.group_kwarg is not None
            or s.target in (expert_dispatch.expert_dispatch_compute, expert_dispatch.expert_dispatch_finish))


def _layer(s: Any) -> bool:
    return (s.kind == "op" and s.target is expert_dispatch.expert_all_to_all and s.group_kwarg is not None
            and s.coshard is None and s.recompute is None and s.grad_enabled and s.output_of is None)


def _rewrite(stmts: list[Any], o: int) -> Optional[tuple[list[Any], tuple]]:
    """The statements with the layer at `o` in three calls and independent ones between, or None."""
    layer = stmts[o]
    b = o - 1
    while b >= 0 and not _communicates(stmts[b]):
        b -= 1
    region = list(range(b + 1, o))
    makers = {out: j for j in region for out in stmts[j].out if out}
    need: set[int] = set()
    todo = [n for n in stmt_reads(layer) if n in makers]
    while todo:
        j = makers[todo.pop()]
        if j not in need:
            need.add(j)
            todo += [n for n in stmt_reads(stmts[j]) if n in makers]
    free = [j for j in region if j not in need]
    out = layer.out[0]
    r = o + 1
    while r < len(stmts) and out not in stmt_reads(stmts[r]) and not _communicates(stmts[r]):
        r += 1
    after = list(range(o + 1, r))
    moved = [stmts[j] for j in free + after]
    if any(s.recompute is not None or s.coshard is not None for s in moved):
        return None
    if not any(s.kind == "op" and s.target in MATMULS for s in moved):
        return None  # nothing worth hiding an all-to-all behind
    started, computed = f"{out}__dispatch", f"{out}__combine"
    start = replace(layer, out=[started], target=expert_dispatch.expert_dispatch_start,
                    comment="counts exchanged; the dispatch all-to-all started")
    compute = replace(layer, out=[computed], target=expert_dispatch.expert_dispatch_compute, args=(Ref(started),),
                      kwargs={}, group_kwarg=None,
                      comment="dispatch waited for; the local experts run; the combine all-to-all started")
    finish = replace(layer, out=[out], target=expert_dispatch.expert_dispatch_finish, args=(Ref(computed),),
                     kwargs={}, group_kwarg=None)
    new = (stmts[:b + 1] + [stmts[j] for j in sorted(need)] + [start] + [stmts[j] for j in free] + [compute]
           + [stmts[j] for j in after] + [finish] + stmts[r:])
    return new, (len(need), len(free), len(after))


def overlap_experts(per_device: dict[tuple[int, int], list[Any]], enabled: bool) -> dict[tuple[int, int], list[Any]]:
    """Every (device, stage) list with its experts layers split around independent compute, where
    every device holding a layer splits it alike."""
    if not enabled:
        return per_device
    verdict: dict[str, Optional[tuple]] = {}
    for stmts in per_device.values():
        for o, s in enumerate(stmts):
            if s.kind == "op" and s.target is expert_dispatch.expert_all_to_all and s.out and s.out[0]:
                made = _rewrite(stmts, o) if _layer(s) else None
                sig = None if made is None else made[1]
                name = s.out[0]
                verdict[name] = sig if name not in verdict or verdict[name] == sig else None
    allowed = {name for name, sig in verdict.items() if sig is not None}
    if not allowed:
        return per_device
    out = {}
    for key, stmts in per_device.items():
        stmts = list(stmts)
        o = 0
        while o < len(stmts):
            s = stmts[o]
            if _layer(s) and s.out[0] in allowed:
                made = _rewrite(stmts, o)
                if made is not None:
                    stmts = made[0]
            o += 1
        out[key] = stmts
    return out
