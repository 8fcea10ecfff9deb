"""FlexAttention kept as one op (`kernels/flex_attention_piece.FlexAttentionCall`): q (B, Hq, L, E),
k (B, Hkv, S, E), v (B, Hkv, S, Ev) -> output (B, Hq, L, Ev) [, log-sum-exp (B, Hq, L)].

Batch rows and heads are spatial: every (row, query head) attends on its own, so a piece of rows
and heads computes exactly that piece of the output, once its block mask is the mask's matching
rows / heads (or the same mask where the mask broadcasts that dim) and its score and mask
functions see global indices -- `flex_attention_piece` does both, so the split holds for functions
that read `b` or `h`. Grouped-query attention groups consecutive query heads per key/value head,
so equal shares of both keep the groups; one key/value head stays whole and serves every piece.

The query sequence splits too (context parallelism): each query attends on its own given every
key and value, so a piece of the queries with the whole keys and values computes that piece of
the output, once its mask and score functions see global query positions. The key / value
sequence stays whole, so a plan that splits the sequence elsewhere gathers them for this op (the
all-gather form of context parallelism, the one torchtitan runs FlexAttention with); the piece
learns which global queries it holds from the plan's split and blocks (contiguous, or the
mirrored 2-block split that balances a causal mask) and builds its block mask for them from the
mask's `mask_mod`. A block mask made from explicit block indices has no mask_mod to rebuild from:
its queries stay whole.

A mask (or score function) made from the batch reads tensors the op takes after q, k, v. Each
piece takes them whole -- the function indexes them with global rows, heads and positions -- so a
plan that splits them elsewhere gathers them for this op (they are small: a few integers per
token).
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.kernels.flex_attention_piece import (
    FlexAttentionCall,
    flex_attention_piece,
    query_chunks_of,
    rebuildable,
    spec_of,
)
from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature


def whole_reason(call: OpCall) -> Optional[str]:
    """Why neither rows nor heads of this call may be split, or None."""
    q, k, v = call.inputs[:3]
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"queries {q.shape}, keys {k.shape}, values {v.shape} are not (batch, heads, seq, dim)"
    return None


def _key(call: OpCall) -> str:
    return call.arg(3, "key")


@rule(FlexAttentionCall)
def flex_attention_call(call: OpCall) -> Optional[Signature]:
    reason = whole_reason(call)
    n_in, n_out = len(call.inputs), len(call.outputs)
    if reason is not None:
        return Signature(inputs=tuple(None for _ in range(n_in)), outputs=tuple(None for _ in range(n_out)),
                         note=f"FlexAttention kept whole: {reason}")
    q, k = call.inputs[0], call.inputs[1]
    mask = spec_of(_key(call)).block_mask
    batch = "b" if k.shape[0] == q.shape[0] else "^b"
    heads = "h" if k.shape[1] == q.shape[1] or (q.shape[1] % k.shape[1] == 0 and k.shape[1] > 1) else "^h"
    kv_heads = heads if k.shape[1] != 1 or q.shape[1] == 1 else "^kh"
    if heads == "^h":
        kv_heads = "^kh"
    if mask is not None:  # a mask dim neither broadcast nor the call's own size cannot be sliced
        if mask.shape[0] not in (1, q.shape[0]):
            batch = "^b"
        if mask.shape[1] not in (1, q.shape[1]):
            heads, kv_heads = "^h", "^kh"
    kv_batch = batch if batch == "b" else "^kb"
    queries = "l" if rebuildable(mask) else "^l"
    ins = ((batch, heads, queries, "^e"), (kv_batch, kv_heads, "^s", "^ke"), (kv_batch, kv_heads, "^s", "^ve")) + \
        tuple(tuple(f"^m{i}.{d}" for d in range(t.ndim)) for i, t in enumerate(call.inputs[3:]))
    outs = ((batch, heads, queries, "^ve"), (batch, heads, queries))[:n_out]
    length = q.shape[2]

    def localize(piece: LocalCall) -> Localized:
        b0 = piece.index.get("b", 0) * piece.local_inputs[0].shape[0]
        h0 = piece.index.get("h", 0) * piece.local_inputs[0].shape[1]
        pieces = piece.splits.get("l", 1)
        chunks = None if pieces == 1 else query_chunks_of(length, pieces, piece.index.get("l", 0),
                                                          piece.blocks.get("l", 1))
        return Localized(flex_attention_piece, (*call.args[:4], b0, h0, chunks, *call.args[7:]))

    return Signature(inputs=ins, outputs=outs, localize=localize,
                     note="FlexAttention: rows, heads and queries split (the block mask sliced or rebuilt to "
                          "match, global b/h/q indices for score_mod / mask_mod); keys and values whole")
