"""Scaled dot-product attention: batch and heads are spatial (grouped-query attention splits the
key/value heads with the query heads: piece i's query heads use exactly piece i's kv heads; a
single key/value head, multi-query attention, stays whole and serves every piece); the feature
dim stays whole.

Self-attention's sequence (queries and keys of one length, no mask tensor, no dropout) is one label
`s` on queries, keys, values and output: splitting it is context parallelism. A piece then holds
its queries and keys for its chunks of the sequence and runs
`runtime.ring_attention.context_parallel_attention` with the group of `s`, which meets every key
by the plan's `cp_comm` option (ring, allgather or ulysses); a mirrored 2-block split of `s` (the
plan's block count -2) is the causal load balancing. Masks given as tensors (padding, packed
documents) keep the sequence whole: their key dim would have to travel with the keys.
"""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.kernels.ring_attention import context_parallel_attention

SEQUENCE = "s"


@rule("aten.scaled_dot_product_attention.default")
def sdpa(call: OpCall) -> Signature:
    q, k, v = call.inputs[:3]
    if q.ndim < 3:
        return None
    lead = q.ndim - 2  # batch-like dims before (seq, feature)
    heads = q.shape[lead - 1] if lead >= 1 else None
    kv_heads = k.shape[lead - 1] if lead >= 1 else None
    gqa = bool(call.kwargs.get("enable_gqa", False)) or (heads != kv_heads)

    def qkv(t, tag):
        labs = []
        for i in range(lead):
            if i == lead - 1 and lead >= 2:
                # one key/value head serves every query head (multi-query attention): it stays
                # whole on every piece, as Megatron keeps K/V heads when there are fewer of them
                # than devices, and the query heads split alone
                mqa = gqa and t.shape[i] == 1 and heads != 1
                labs.append(f"^{tag}h" if mqa else "h" if (t.shape[i] == heads or gqa) else f"^{tag}h")
            else:
                labs.append(f"d{i}" if t.shape[i] == q.shape[i] else f"^{tag}{i}")
        return tuple(labs) + (f"^{tag}s", f"^{tag}e")

    cp_ok = sequence_split_problem(call) is None
    seq = lambda tag: SEQUENCE if cp_ok else f"^{tag}s"  # noqa: E731
    ins = [qkv(q, "q"), qkv(k, "k"), qkv(v, "v")]
    ins = [t[:-2] + (seq(tag), t[-1]) for t, tag in zip(ins, "qkv")]
    if lead == 1:  # (batch, seq, feature): only the batch dim
        ins = [(("d0" if t.shape[0] == q.shape[0] else f"^{tag}0"), seq(tag), f"^{tag}e")
               for t, tag in ((q, "q"), (k, "k"), (v, "v"))]
    out_shape = call.outputs[0].shape
    for m in call.inputs[3:]:  # attention mask, broadcast against (batch..., L, S)
        labs = []
        off = len(out_shape) - m.ndim
        for j, s in enumerate(m.shape):
            i = j + off
            if i < lead and s == out_shape[i] and s != 1:
                labs.append(ins[0][i] if not ins[0][i].startswith("^") else f"^m{j}")
            else:
                labs.append(f"^m{j}")
        ins.append(tuple(labs))
    out = ins[0][:lead] + (seq("o"), "^oe")
    return Signature(inputs=tuple(ins), outputs=(out,), localize=_localize if cp_ok else None,
                     note="" if cp_ok else f"sequence kept whole: {sequence_split_problem(call)}")


def sequence_split_problem(call: OpCall) -> str | None:
    """Why this attention call's sequence may not be split across devices, or None."""
    q, k = call.inputs[0], call.inputs[1]
    if q.ndim < 3:
        return "attention without a batch or head dim"
    if len(call.inputs) > 3:
        return "the attention mask is a tensor (padding or packed documents)"
    if q.shape[-2] != k.shape[-2]:
        return f"queries ({q.shape[-2]}) and keys ({k.shape[-2]}) have different lengths (cross-attention)"
    if float(call.arg(4, "dropout_p", 0.0) or 0.0) != 0.0:
        return "attention dropout"
    return None


def _localize(lc: LocalCall) -> Localized:
    call = lc.call
    if lc.splits.get(SEQUENCE, 1) == 1:
        return Localized(call.target, call.args, call.kwargs)
    q, k, v = call.args[:3]
    causal = bool(call.arg(5, "is_causal", False))
    scale = call.kwargs.get("scale")
    block = lc.blocks.get(SEQUENCE, 1)
    if block not in (1, -2):
        raise ValueError(f"context-parallel attention takes a contiguous or mirrored 2-block sequence split, "
                         f"not {block} blocks")
    mode = lc.kernels.cp_comm
    return Localized(context_parallel_attention, (q, k, v),
                     {"is_causal": causal, "scale": scale, "balanced": block == -2, "mode": mode},
                     group_label=SEQUENCE)
