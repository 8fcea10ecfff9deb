"""The tensor-parallel collectives next to matmuls, fused with them so they overlap (tp_comm_overlap).

After the per-op lowering every device's statements hold, around a tensor-parallel matmul, a
collective as a statement of its own: an all-gather of a sequence-split input (with a backward
gradient sum) before a column-parallel matmul, a gradient sum alone before one without sequence
parallelism, an all-reduce or reduce-scatter of a row-parallel matmul's partial sums after it.
This pass replaces each such run of statements by one call of `kernels/tp_matmul.py`, which
pipelines the collective with the matmul in chunks (and, in backward, the input gradient's
reduction with the weight gradients), as the simulator prices a plan with `tp_comm_overlap`.

What is fused, per device (anything else is left as it was, and runs exactly as before):

- input side: an all-gather along a dim other than the last (one step, blocks >= 1) or a
  gradient sum, then views that keep the contracted dim last (they only regroup rows), at most
  one gradient sum over the same devices, ending in matmuls (`addmm`, `mm`, `matmul`, `linear`
  with a 2-D weight) that read it as their input, every value in between read by nothing else;
  the matmuls' weights and biases exist where the first of them runs;
- output side: a matmul whose output, through such views and read by nothing else, is all-reduced
  or reduce-scattered (one step) along a dim other than the last.

Statements keep their recompute group (all fused ones share one), none of them may be co-sharded,
run without gradients or serve only a model output. A plan with `tp_comm_overlap=False` is not
fused; None (the default) and True are, and the kernel's chunk count follows the switch and the
backend (`tp_matmul.chunk_count`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.kernels import tp_matmul
from nnscaler_plugins.lower.resharding import ReshardPlan, StepKind

aten = torch.ops.aten
MATMULS = {aten.addmm.default: "addmm", aten.mm.default: "mm", aten.matmul.default: "matmul",
           aten.linear.default: "linear"}
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)


@dataclass
class Tables:
    """What the pass reads of the lowering, and the kernel-group table it adds to."""

    reshards: list[ReshardPlan]
    grad_groups: list[tuple[tuple[int, ...], ...]]
    kernel_groups: list[tuple[tuple[int, ...], ...]]
    local_shape: Callable[[str], Optional[tuple[int, ...]]]  # this device's shape of a value (None: unknown)
    overlap: Optional[bool]  # the plan's tp_comm_overlap (None: the backend's default)
    # ops whose matmul runs another kernel (a precision="fp8" plan's float8 linears): never fused
    keep_ops: frozenset = frozenset()


@dataclass
class _Uses:
    """Where each value of one statement list is read, and where it is made."""

    readers: dict[str, list[int]] = field(default_factory=dict)
    maker: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, stmts: list[Any]) -> "_Uses":
        u = cls()
        for i, s in enumerate(stmts):
            for n in stmt_reads(s):
                u.readers.setdefault(n, []).append(i)
            for o in s.out:
                if o:
                    u.maker.setdefault(o, i)
        return u


def stmt_reads(s: Any) -> list[str]:
    """The values a statement reads."""
    names = [s.src] if s.src else []
    names += [leaf.name for leaf in torch.utils._pytree.tree_leaves((s.args, s.kwargs)) if isinstance(leaf, Ref)]
    if s.coshard is not None:
        names += list(s.coshard.in_vars)
    return names


def _own(groups: tuple[tuple[int, ...], ...], device: int) -> Optional[tuple[int, ...]]:
    return next((g for g in groups if device in g), None)


def _order(members: tuple[int, ...]) -> tuple[int, ...]:
    """Group ranks in piece order (what `Step.apply` passes its collectives)."""
    ranked = sorted(members)
    return tuple(ranked.index(m) for m in members)


def _plain(s: Any) -> bool:
    return s.coshard is None and s.grad_enabled and s.output_of is None


def _matmul_form(s: Any, keep_ops: frozenset = frozenset()) -> Optional[str]:
    """The form of a matmul statement the kernels take, or None (also for an op in `keep_ops`)."""
    if s.kind != "op" or s.group_kwarg is not None or s.kwargs or not _plain(s):
        return None
    if s.op is not None and s.op.name in keep_ops:
        return None
    form = MATMULS.get(s.target)
    if form is None:
        return None
    n = len(s.args)
    if form == "addmm" and n != 3 or form in ("mm", "matmul") and n != 2 or form == "linear" and n not in (2, 3):
        return None
    if not all(isinstance(a, Ref) or (form == "linear" and i == 2 and a is None) for i, a in enumerate(s.args)):
        return None
    return form


def _x_index(form: str) -> int:
    return 1 if form == "addmm" else 0


def _weight(form: str, s: Any) -> str:
    return s.args[2].name if form == "addmm" else s.args[1].name


def _bias(form: str, s: Any) -> Optional[str]:
    if form == "addmm":
        return s.args[0].name
    if form == "linear" and len(s.args) == 3 and s.args[2] is not None:
        return s.args[2].name
    return None


def _dims(form: str, w: tuple[int, ...]) -> tuple[int, int]:
    """(contracted K, out N) of a 2-D weight."""
    return (w[1], w[0]) if form == "linear" else (w[0], w[1])


def _view_shape(s: Any) -> Optional[list[int]]:
    """A view statement's target shape (an alias keeps its input's): None when it is not a view of
    one value with a literal shape."""
    if s.kind != "op" or s.target not in VIEWS or s.kwargs or s.group_kwarg is not None or not _plain(s):
        return None
    if s.target is aten.alias.default:
        return [] if len(s.args) == 1 and isinstance(s.args[0], Ref) else None
    if len(s.args) != 2 or not isinstance(s.args[0], Ref):
        return None
    shape = s.args[1]
    if not isinstance(shape, (list, tuple)) or not all(type(v) is int for v in shape):
        return None
    return list(shape)


def fuse(stmts: list[Any], device: int, keep: set[str], t: Tables,
         allowed: Optional[set[str]] = None) -> tuple[list[Any], dict[str, tuple], set[str]]:
    """`stmts` (one device, one stage) with the tensor-parallel collectives next to matmuls fused into
    `tp_matmul` calls; `keep`: values the stage returns (never fused away); `allowed`: the runs that
    may be fused, named by the value their first statement makes (None: every run that fits).

    Returns the statements, what was fused (name -> what the devices of its group must agree on) and
    every run looked at. The devices of a group run one collective together, so a run is fused only
    where every device that has it fuses it alike: `fuse_program` runs this once to see, then again
    with the runs all agree on."""
    if t.overlap is False:
        return stmts, {}, set()
    stmts = list(stmts)
    uses: list[Optional[_Uses]] = [None]  # where values are read, made again after each fusion
    fused: dict[str, tuple] = {}
    seen: set[str] = set()

    def current() -> _Uses:
        if uses[0] is None:
            uses[0] = _Uses.of(stmts)
        return uses[0]

    i = 0
    while i < len(stmts):
        s = stmts[i]
        done = None
        name = s.out[0] if s.out else None
        if name and (s.kind in ("reshard", "grad_sum") or (s.kind == "op" and s.target in MATMULS)):
            seen.add(name)
            if allowed is None or name in allowed:
                if s.kind in ("reshard", "grad_sum"):
                    done = _fuse_input_side(stmts, i, device, keep, t, current())
                else:
                    done = _fuse_output_side(stmts, i, device, keep, t, current())
        if done is not None:
            fused[name] = done
            uses[0] = None  # a fused run may start another at the same place
        else:
            i += 1
    return stmts, fused, seen


def fuse_program(per_device: dict[tuple[int, int], list[Any]], keep: set[str],
                 tables: Callable[[int, list[Any]], Tables]) -> dict[tuple[int, int], list[Any]]:
    """`fuse` on every (device, stage) statement list, keeping only the runs every device that has
    them fuses alike (`tables(stage, stmts)` gives one list's tables; the kernel groups it adds are
    made on the second run only)."""
    looked: dict[tuple[int, int], tuple[dict[str, tuple], set[str]]] = {}
    for (dev, k), stmts in per_device.items():
        t = tables(k, stmts)
        t = replace(t, kernel_groups=list(t.kernel_groups))  # a first look adds nothing to the program's table
        _, fused, seen = fuse(stmts, dev, keep, t)
        looked[(dev, k)] = (fused, seen)
    verdict: dict[str, Optional[tuple]] = {}
    for fused, seen in looked.values():
        for name in seen:
            mine = fused.get(name)
            if name not in verdict:
                verdict[name] = mine
            elif verdict[name] != mine:
                verdict[name] = None
    allowed = {name for name, v in verdict.items() if v is not None}
    out = {}
    for (dev, k), stmts in per_device.items():
        out[(dev, k)] = fuse(stmts, dev, keep, tables(k, stmts), allowed)[0]
    return out


# -- input side -------------------------------------------------------------------------------------
def _fuse_input_side(stmts: list[Any], i: int, device: int, keep: set[str], t: Tables,
                     uses: _Uses) -> Optional[tuple]:
    src = stmts[i]
    gather = None  # (dim, blocks, order) of the all-gather
    members: Optional[tuple[int, ...]] = None
    absorbed: list[int] = []
    if src.kind == "reshard" and _plain(src):
        rp = t.reshards[src.key]
        if len(rp.steps) != 1 or rp.steps[0].kind is not StepKind.ALL_GATHER:
            return None
        step = rp.steps[0]
        members = _own(step.groups, device)
        blocks = step.src.blocks[step.dim]
        if members is None or len(members) < 2 or blocks < 1 or step.dim == len(rp.dst.shape) - 1:
            return None
        gather = (step.dim, blocks, _order(members))
        k_in = rp.dst.local_shape()[-1]
        absorbed.append(src.key)
        grad_members = None
    elif src.kind == "grad_sum" and _plain(src):
        grad_members = _own(t.grad_groups[src.key], device)
        if grad_members is None or len(grad_members) < 2:
            return None
        shape = t.local_shape(src.src)
        if not shape or len(shape) < 2:
            return None
        k_in = shape[-1]
    else:
        return None
    recompute = src.recompute
    # Walk the values made from the source: views, one gradient sum, then matmuls reading them.
    inner: list[int] = [i]  # statements fused away
    matmuls: list[tuple[int, str]] = []
    final_shape: dict[int, Optional[list[int]]] = {}  # matmul index -> its input's shape (None: as made)
    grad_sums = [i] if src.kind == "grad_sum" else []
    frontier: list[tuple[str, Optional[list[int]], bool]] = [(src.out[0], None, bool(grad_sums))]
    while frontier:
        var, shape, summed = frontier.pop()
        if var in keep:
            return None
        for j in uses.readers.get(var, []):
            s = stmts[j]
            if s.recompute != recompute:
                return None
            form = _matmul_form(s, t.keep_ops)
            if form is not None and s.args[_x_index(form)] == Ref(var) and \
                    sum(1 for a in s.args if a == Ref(var)) == 1:
                if not summed and grad_sums:
                    return None  # one matmul's input gradient summed, another's not
                w = t.local_shape(_weight(form, s))
                if w is None or len(w) != 2 or _dims(form, w)[0] != k_in:
                    return None
                matmuls.append((j, form))
                final_shape[j] = shape
                continue
            view = _view_shape(s)
            if view is not None and s.out and len(s.out) == 1 and s.out[0]:
                new = shape if view == [] else view
                if new is not None and (len(new) < 2 or new[-1] != k_in):
                    return None
                inner.append(j)
                frontier.append((s.out[0], new, summed))
                continue
            if s.kind == "grad_sum" and _plain(s) and not summed and gather is not None:
                g = _own(t.grad_groups[s.key], device)
                if g is None or set(g) != set(members):
                    return None
                grad_sums.append(j)
                inner.append(j)
                frontier.append((s.out[0], shape, True))
                continue
            return None  # read by something the kernel cannot stand in for
    if not matmuls:
        return None
    if gather is not None and grad_sums and any(not _summed_path(stmts, uses, m, grad_sums[0]) for m, _ in matmuls):
        return None
    first = min(m for m, _ in matmuls)
    if any(j > first for j in inner):
        return None  # a view or gradient sum placed after the first matmul: the order would change
    forms, operands, outs = [], [], []
    shapes = {tuple(v) if v is not None else None for v in final_shape.values()}
    if len(shapes) != 1:
        return None  # the matmuls read the input through different views
    for j, form in sorted(matmuls):
        s = stmts[j]
        for name in (_weight(form, s), _bias(form, s)):
            if name is not None and uses.maker.get(name, -1) >= first:
                return None  # made after the first matmul: not there when the fused call runs
        forms.append(form)
        operands += [Ref(_weight(form, s)), Ref(_bias(form, s)) if _bias(form, s) else None]
        outs.append(s.out[0])
    if gather is not None:
        grad = "reduce-scatter" if grad_sums else "local"
        group = tuple(members)
    else:
        grad = "all-reduce"
        group = tuple(grad_members)
    gk = len(t.kernel_groups)
    t.kernel_groups.append(_groups_of(src, t, gather is not None))
    shape = next(iter(shapes))
    head = stmts[first]
    fused = replace(head, kind="op", out=outs, target=tp_matmul.gathered_matmuls,
                    args=(Ref(src.src), *operands),
                    kwargs={"forms": forms, "shape": None if shape is None else list(shape),
                            "gather": None if gather is None else [gather[0], gather[1], list(gather[2])],
                            "grad": grad, "overlap": t.overlap},
                    src=None, key=-1, group_kwarg=gk, coshard=None, fused_reshards=tuple(absorbed), tuple_out=True,
                    comment=_comment(gather, grad, group, len(forms)))
    drop = set(inner) | {m for m, _ in matmuls}
    out = [fused if j == first else s for j, s in enumerate(stmts) if j not in drop or j == first]
    stmts[:] = out
    return ("in", tuple(forms), grad, None if gather is None else gather[:2], shape, len(operands))


def _summed_path(stmts: list[Any], uses: _Uses, matmul: int, grad_sum: int) -> bool:
    """Whether the matmul's input was made through the gradient sum (walking back its makers)."""
    var = stmts[matmul].args[_x_index(MATMULS[stmts[matmul].target])].name
    while var in uses.maker:
        j = uses.maker[var]
        if j == grad_sum:
            return True
        s = stmts[j]
        if s.kind == "reshard":
            return False
        var = s.src if s.kind == "grad_sum" else s.args[0].name
    return False


def _groups_of(src: Any, t: Tables, gathered: bool) -> tuple[tuple[int, ...], ...]:
    if gathered:
        return tuple(tuple(g) for g in t.reshards[src.key].steps[0].groups)
    return tuple(tuple(g) for g in t.grad_groups[src.key])


def _comment(gather: Optional[tuple], grad: str, group: tuple[int, ...], n: int) -> str:
    what = f"{n} matmul{'s' if n > 1 else ''}"
    if gather is not None:
        return (f"all-gather dim {gather[0]} over devices {sorted(group)} in chunks pipelined with {what}; "
                f"backward: {grad} of the input gradient beside the weight gradients")
    return f"{what}; backward: all-reduce of the input gradient over devices {sorted(group)} beside the weight gradients"


# -- output side ------------------------------------------------------------------------------------
def _fuse_output_side(stmts: list[Any], i: int, device: int, keep: set[str], t: Tables,
                      uses: _Uses) -> Optional[tuple]:
    m = stmts[i]
    form = _matmul_form(m, t.keep_ops)
    if form is None or not m.out or not m.out[0]:
        return None
    w = t.local_shape(_weight(form, m))
    if w is None or len(w) != 2:
        return None
    n_out = _dims(form, w)[1]
    var, shape, inner = m.out[0], None, []
    while True:
        if var in keep:
            return None
        readers = uses.readers.get(var, [])
        if len(readers) != 1:
            return None
        j = readers[0]
        s = stmts[j]
        if s.recompute != m.recompute:
            return None
        view = _view_shape(s)
        if view is not None and s.out and len(s.out) == 1 and s.out[0]:
            if view and (len(view) < 2 or view[-1] != n_out):
                return None
            shape = view or shape
            inner.append(j)
            var = s.out[0]
            continue
        if s.kind != "reshard" or not _plain(s) or s.src != var:
            return None
        rp = t.reshards[s.key]
        if len(rp.steps) != 1 or rp.steps[0].kind not in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER):
            return None
        step = rp.steps[0]
        members = _own(step.groups, device)
        if members is None or len(members) < 2:
            return None
        scatter = None
        if step.kind is StepKind.REDUCE_SCATTER:
            blocks = step.dst.blocks[step.dim]
            if blocks < 1 or step.dim == len(rp.src.shape) - 1:
                return None
            scatter = [step.dim, blocks, list(_order(members))]
        break
    gk = len(t.kernel_groups)
    t.kernel_groups.append(tuple(tuple(g) for g in step.groups))
    what = "all-reduce" if scatter is None else f"reduce-scatter dim {scatter[0]}"
    fused = replace(s, kind="op", out=[s.out[0]], target=tp_matmul.reduced_matmul, args=(form, *m.args),
                    kwargs={"shape": shape, "scatter": scatter, "overlap": t.overlap}, src=None, key=-1,
                    group_kwarg=gk, op=m.op, coshard=None, fused_reshards=(s.key,),
                    comment=f"{m.out[0]} (the matmul) with the {what} of its rows over devices {sorted(members)} "
                            "in chunks, each summed while the next computes")
    drop = {i, *inner}
    stmts[:] = [fused if k == j else st for k, st in enumerate(stmts) if k not in drop]
    return ("out", form, None if scatter is None else tuple(scatter[:2]), None if shape is None else tuple(shape))
