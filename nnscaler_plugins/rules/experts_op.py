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
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.kernels.experts_module import ExpertsCall
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
