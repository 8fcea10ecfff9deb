"""The rule of a mixture-of-experts layer captured as one op (`capture/experts.py`).

`ExpertsCall(x (T, H), ids (T, K), weights (T, K), key, names, *stacked weights (E, ...))`.

One label, `t`, marks both the tokens (dim 0 of x, ids, weights and the output) and the experts
(dim 0 of every stacked weight). Splitting it into `n` pieces is expert parallelism: piece `i`
holds the i-th chunk of the tokens *and* the i-th share of the experts, and the tokens reach the
experts that were chosen for them by all-to-all inside the piece's kernel
(`runtime.expert_dispatch.expert_all_to_all`, given the label's device group). Its output is the
piece's own tokens, finished: a plain token split, so what follows runs on its tokens as data
parallelism would. The hidden dims stay whole.

The label is a communicating one (`comm_labels`): a piece cannot run without its group. A plan's
`capacity_factor` option (the ep strategy's) reaches the kernel through the op's localized call.
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.runtime.experts_module import ExpertsCall
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.runtime import expert_dispatch

SPLIT = "t"


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
        factor = capacity_factor if capacity_factor is not None else lc.options.get("capacity_factor")
        if factor is not None:
            kwargs["capacity_factor"] = float(factor)
        return Localized(expert_dispatch.expert_all_to_all, tuple(refs), kwargs, group_label=SPLIT)

    return Signature(
        inputs=((SPLIT, "^h"), (SPLIT, "^k"), (SPLIT, "^k"), *((SPLIT,) + _frozen(f"p{i}_", p.ndim - 1)
                                                              for i, p in enumerate(params))),
        outputs=((SPLIT, "^h"),),
        localize=localize, comm_labels=frozenset({SPLIT}),
        note="experts split with their tokens: all-to-all dispatch and combine")


@rule(ExpertsCall)
def experts_call(call: OpCall) -> Optional[Signature]:
    return experts_signature(call)
