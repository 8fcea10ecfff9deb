"""The rule of a mixture-of-experts layer captured as one op (`capture/experts.py`).

`ExpertsCall(x (T, H), ids (T, K), weights (T, K), key, names, *stacked weights (E, ...))`.

One label, `t`, marks both the tokens (dim 0 of x, ids, weights and the output) and the experts
(dim 0 of every stacked weight). Splitting it into `n` pieces is expert parallelism: piece `i`
holds the i-th chunk of the tokens *and* the i-th share of the experts, and the tokens reach the
experts that were chosen for them by all-to-all inside the piece's kernel
(`runtime.expert_dispatch.expert_all_to_all`, given the label's device group). Its output is the
piece's own tokens, finished: a plain token split, so what follows runs on its tokens as data
parallelism would. The hidden dims stay whole.

A second label, `f`, marks each expert's intermediate width (`rules/experts_intermediate.py` finds
which weight dims hold it, and their fused sections, by probing the module): splitting it is tensor
parallelism inside each expert. Every piece then holds a slice of every expert's width and computes
a partial sum of its tokens' outputs (`f` is a reduce label), which the lowering adds up where the
next op needs it. Split along both, the all-to-all runs among the pieces holding the same slice of
the width (the group of `t`), as Megatron's expert tensor parallelism does.

The label `t` is a communicating one (`comm_labels`): a piece cannot run without its group. A plan's
`capacity_factor` option (the ep strategy's) reaches the kernel through the op's localized call.

The sorted form, `SortedExpertsCall(x (N, H) rows sorted by expert, counts (E,), probs (N,) or
None, key, names, *stacked weights (E, ...))`, has the same two labels. `t` marks the rows and the
experts: piece `i` holds the i-th chunk of the sorted rows (whatever experts they belong to; the
whole counts, a few numbers, tell it which) and the i-th share of the experts, and
`expert_dispatch.sorted_expert_all_to_all` moves each row to its expert's device and back. It is
offered only where running the module proves it exact (`capture/experts_probe.py`): a piece of the
rows with its own counts, and a share of the experts with their weights, give the same rows. `f`
is found as for the routed form. A module holding its experts as a `ModuleList` has neither: it
runs whole.
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.capture.experts_probe import ExpertsLayout, experts_split_exactly, rows_split_exactly
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.capture.graph import TensorMeta
from nnscaler_plugins.kernels.experts_module import ExpertsCall, SortedExpertsCall, sorted_convention
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.rules.experts_intermediate import intermediate_dims
from nnscaler_plugins.kernels import expert_dispatch

SPLIT = "t"
WIDTH = "f"


def _frozen(prefix: str, ndim: int) -> tuple[str, ...]:
    return tuple(f"^{prefix}{d}" for d in range(ndim))


def experts_signature(call: OpCall, capacity_factor: Optional[float] = None) -> Optional[Signature]:
    """The signature above; None (replicated) when the call does not have the experts' shape."""
    if len(call.inputs) < 4:
        return None
    x, ids, w, *params = call.inputs
    if x.ndim != 2 or ids.ndim != 2 or w.ndim != 2 or any(p.ndim < 2 for p in params):
        return None
    experts = params[0].shape[0]
    if any(p.shape[0] != experts for p in params):
        return None
    key, names = call.args[3], tuple(call.args[4])
    refs = call.args[:3] + call.args[5:]

    def localize(lc: LocalCall) -> Localized:
        if SPLIT not in lc.splits:
            return Localized(call.target, call.args, call.kwargs)
        local = lc.local_inputs[3].shape[0]
        kwargs = dict(key=key, names=names, first_expert=lc.index[SPLIT] * local, num_experts=experts)
        factor = capacity_factor if capacity_factor is not None else lc.kernels.capacity_factor
        if factor is not None:
            kwargs["capacity_factor"] = float(factor)
        return Localized(expert_dispatch.expert_all_to_all, tuple(refs), kwargs, group_label=SPLIT)

    width = intermediate_dims(key, names, [tuple(p.shape) for p in params], x.shape[1], ids.shape[1])
    weight_labels = []
    blocks = {}
    added_once = set()  # weights without the width, added once (given to one piece of a width split)
    for i, p in enumerate(params):
        labels = list((SPLIT,) + _frozen(f"p{i}_", p.ndim - 1))
        if width is not None and width.dims[i] is None:
            added_once.add(3 + i)
        elif width is not None:
            dim, sections = width.dims[i]
            labels[dim] = WIDTH
            if sections > 1:
                blocks[(WIDTH, 3 + i)] = sections
        weight_labels.append(tuple(labels))
    return Signature(
        inputs=((SPLIT, "^h"), (SPLIT, "^k"), (SPLIT, "^k"), *weight_labels),
        outputs=((SPLIT, "^h"),),
        reduce=frozenset({WIDTH}) if width is not None else frozenset(),
        partial_inputs={WIDTH: frozenset(added_once)} if added_once else {},
        blocks=blocks, localize=localize, comm_labels=frozenset({SPLIT}),
        note="experts split with their tokens: all-to-all dispatch and combine"
             + ("; each expert's width split: partial sums" if width is not None else ""))


@rule(ExpertsCall)
def experts_call(call: OpCall) -> Optional[Signature]:
    return experts_signature(call)


def experts_parts(call: OpCall) -> tuple[TensorMeta, tuple[TensorMeta, ...]]:
    """The token (or sorted-row) matrix and the expert weights of an experts op, either form."""
    if isinstance(getattr(call.target, "cls", None), type) and call.target.cls is SortedExpertsCall:
        start = 3 if call.args[2] is not None else 2
        return call.inputs[0], tuple(call.inputs[start:])
    return call.inputs[0], tuple(call.inputs[3:])


_SPLITS_EXACTLY: dict[tuple, bool] = {}


def _rows_and_experts_split(key: str, layout: ExpertsLayout, hidden: int, probs: bool) -> bool:
    cache = (key, layout, hidden, probs)
    if cache not in _SPLITS_EXACTLY:
        _SPLITS_EXACTLY[cache] = (rows_split_exactly(key, layout.names, layout, hidden, probs)
                                  and experts_split_exactly(key, layout.names, layout, hidden, probs))
    return _SPLITS_EXACTLY[cache]


def _whole(call: OpCall) -> Signature:
    """Runs whole (every dim frozen), its counts still the counts of its own rows."""
    return Signature(inputs=tuple(None for _ in call.inputs), outputs=tuple(None for _ in call.outputs),
                     row_counts=frozenset({1}), note="experts run whole")


def sorted_experts_signature(call: OpCall) -> Optional[Signature]:
    """The signature of a sorted-experts op (module docstring); None (whole) when neither split is
    proved exact, or the experts are not stacked weights."""
    has_probs = call.args[2] is not None
    x, counts = call.inputs[0], call.inputs[1]
    params = call.inputs[3:] if has_probs else call.inputs[2:]
    key, names = call.args[3], tuple(call.args[4])
    experts = counts.shape[0]
    if sorted_convention(key) is None or x.ndim != 2 or not params or \
            any(p.ndim < 2 or p.shape[0] != experts for p in params):
        return _whole(call)
    layout = ExpertsLayout("stacked", experts, names, tuple(tuple(p.shape) for p in params))
    by_rows = _rows_and_experts_split(key, layout, x.shape[1], has_probs)
    width = intermediate_dims(key, names, [tuple(p.shape) for p in params], x.shape[1], 1)
    if not by_rows and width is None:
        return _whole(call)
    rows = SPLIT if by_rows else "^r"
    refs = call.args[:3] + call.args[5:]
    start = 3 if has_probs else 2

    def localize(lc: LocalCall) -> Localized:
        if SPLIT not in lc.splits:
            return Localized(call.target, call.args, call.kwargs)
        if lc.kernels.capacity_factor is not None:
            raise PlanError("capacity_factor drops routed rows of experts called with (tokens, ids, weights); this "
                            "experts module takes rows already sorted by expert, whose dispatch drops none: plan it "
                            "with capacity_factor=None")
        kwargs = dict(key=key, names=names, first_row=lc.index[SPLIT] * lc.local_inputs[0].shape[0],
                      first_expert=lc.index[SPLIT] * lc.local_inputs[start].shape[0], num_experts=experts)
        return Localized(expert_dispatch.sorted_expert_all_to_all, tuple(refs), kwargs, group_label=SPLIT)

    inputs: list = [(rows, "^h"), None]
    if has_probs:
        inputs.append((rows,) + _frozen("q", call.inputs[2].ndim - 1))
    blocks = {}
    added_once = set()
    for i, p in enumerate(params):
        labels = list(((SPLIT,) if by_rows else ("^e",)) + _frozen(f"p{i}_", p.ndim - 1))
        if width is not None and width.dims[i] is None:
            added_once.add(start + i)
        elif width is not None:
            dim, sections = width.dims[i]
            labels[dim] = WIDTH
            if sections > 1:
                blocks[(WIDTH, start + i)] = sections
        inputs.append(tuple(labels))
    return Signature(
        inputs=tuple(inputs), outputs=((rows, "^h"),),
        reduce=frozenset({WIDTH}) if width is not None else frozenset(),
        partial_inputs={WIDTH: frozenset(added_once)} if added_once else {},
        blocks=blocks, localize=localize, comm_labels=frozenset({SPLIT}) if by_rows else frozenset(),
        row_counts=frozenset({1}),
        note=("sorted rows split with the experts: all-to-all dispatch and combine" if by_rows else "")
             + ("; each expert's width split: partial sums" if width is not None else ""))


@rule(SortedExpertsCall)
def sorted_experts_call(call: OpCall) -> Optional[Signature]:
    return sorted_experts_signature(call)
