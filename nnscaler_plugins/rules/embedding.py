"""Embedding lookups: the vocabulary dim of the table is a reduction (vocabulary-parallel)."""
from __future__ import annotations

from nnscaler_plugins.rules.registry import rule
from nnscaler_plugins.rules.signature import LocalCall, Localized, OpCall, Signature
from nnscaler_plugins.kernels import piece_functions


@rule("aten.embedding.default")
def embedding(call: OpCall) -> Signature:
    ids = call.inputs[1]
    idl = tuple(f"d{i}" for i in range(ids.ndim))

    def localize(lc: LocalCall) -> Localized:
        if "v" not in lc.splits:
            return Localized(call.target, call.args, call.kwargs)
        rows = lc.local_inputs[0].shape[0]
        args = list(call.args)
        padding_idx = call.arg(2, "padding_idx", -1)
        return Localized(piece_functions.vocab_parallel_embedding, (args[0], args[1], lc.index["v"] * rows, padding_idx))

    return Signature(inputs=(("v", "e"), idl), outputs=(idl + ("e",),), reduce=frozenset({"v"}), localize=localize)
