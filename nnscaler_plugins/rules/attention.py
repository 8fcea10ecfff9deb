"""Scaled dot-product attention: batch and heads are spatial (grouped-query attention splits the
key/value heads with the query heads: piece i's query heads use exactly piece i's kv heads; a
single key/value head, multi-query attention, stays whole and serves every piece); sequence and
feature dims stay whole."""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import OpCall, Signature


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

    ins = [qkv(q, "q"), qkv(k, "k"), qkv(v, "v")]
    if lead == 1:  # (batch, seq, feature): only the batch dim
        ins = [(("d0" if t.shape[0] == q.shape[0] else f"^{tag}0"), f"^{tag}s", f"^{tag}e")
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
    out = ins[0][:lead] + ("^os", "^oe")
    return Signature(inputs=tuple(ins), outputs=(out,))
