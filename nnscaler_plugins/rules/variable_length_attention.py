"""Variable-length attention (`torch.nn.attention.varlen.varlen_attn`, captured as
`torch_attn._varlen_attn`): documents packed one after another into a token dim, `(tokens, heads,
head_dim)`, their boundaries given by the cumulative lengths `cu_seq_q` / `cu_seq_k`.

Heads are spatial: every head attends within each document on its own, so piece i of the query
heads with piece i of the key/value heads (grouped-query attention groups consecutive query heads
per key/value head, so equal shares keep the groups) is exactly piece i of the output and of the
log-sum-exp `(heads, tokens)`. The token dim stays whole: a cut would fall inside a document
unless it happened to land on a boundary the data decides, so neither a batch split nor context
parallelism applies to it (split the batch before packing, or use scaled_dot_product_attention
with a sequence the plan may split). A paged key/value cache (`block_table`) or `seqused_k` keeps
the op whole: their rows index the key/value tensors by position.
"""
from __future__ import annotations

from typing import Optional

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature

#: The captured op's name (the public function `varlen_attn` calls it).
VARLEN_ATTENTION = "torch_attn._varlen_attn.default"


def whole_reason(call: OpCall) -> Optional[str]:
    """Why the heads of this call may not be split either, or None."""
    q, k = call.inputs[0], call.inputs[1]
    if q.ndim != 3 or k.ndim != 3:
        return f"queries {q.shape} and keys {k.shape} are not (tokens, heads, head_dim)"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
    for name, at in (("seqused_k", 11), ("block_table", 12)):
        if call.arg(at, name, None) is not None:
            return f"{name} is given (a paged or partly used key/value cache)"
    return None


@rule(VARLEN_ATTENTION)
def varlen_attention(call: OpCall) -> Signature:
    reason = whole_reason(call)
    n_in, n_out = len(call.inputs), len(call.outputs)
    if reason is not None:
        return Signature(inputs=tuple(None for _ in range(n_in)), outputs=tuple(None for _ in range(n_out)),
                         note=f"variable-length attention kept whole: {reason}")
    q, k = call.inputs[0], call.inputs[1]
    # one key/value head serves every query head: it stays whole and serves every piece
    kv_head = "^kh" if k.shape[1] == 1 and q.shape[1] != 1 else "h"
    ins = [("^qt", "h", "^qe"), ("^kt", kv_head, "^ke"), ("^vt", kv_head, "^ve")]
    ins += [tuple(f"^c{i}_{d}" for d in range(m.ndim)) for i, m in enumerate(call.inputs[3:])]
    outs = [("^ot", "h", "^oe"), ("h", "^lt"), ("^r",)][:n_out]
    return Signature(inputs=tuple(ins), outputs=tuple(outs),
                     note="packed documents: the token dim stays whole, heads split")
