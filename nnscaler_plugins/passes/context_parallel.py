"""Context parallelism: the sequence split across the devices of a unit, attention included.

Activations, not weights, run out of memory on long sequences; splitting the sequence of every op
that carries it divides them by cp. The plan is found by a walk, not by module names: the
sequence starts at the graph's data inputs (the dim of the attention's length) and at every
self-attention's sequence label, and follows each op's dimension rule to its outputs. Ops the
sequence does not reach (position aranges, label shifts, rotary tables) run whole; where their
outputs meet split ones, the lowering cuts them to the same pieces, so positions and labels stay
consistent with the split with no special case. Attention pieces run
`kernels.ring_attention.context_parallel_attention` with the group of the sequence label and the
plan's `cp_comm` ("ring", "allgather" or "ulysses").

Causal load balancing (on by default when some attention is causal): the sequence is split as a
mirrored 2-block split, device j holding chunks j and 2cp-1-j of 2cp, on every op the sequence
reaches. A reshape merging batch and sequence (the LM head's logits flattened for the loss) keeps
it: the merged dim holds each row's pieces as rows x 2 mirrored blocks, and the walk follows it
into the loss, whose rows are split in those blocks (cross-entropy's mean is the local sum over the
global count). Ops that cannot take the split get their inputs gathered by the lowering, which is
exact and costs memory there.

With `pp`, the layer stack is cut into stages as the pipeline strategies cut it, each stage on its
own cp x tp devices; the walk above is one over the whole graph, so a value crossing stages keeps
its pieces' meaning, and each attention's ring is the group of its own stage's devices.

What cannot run exactly is refused before launch, with sizes: a length not divisible by 2cp
(balanced) or cp, Ulysses with more devices than key/value heads (or query heads), attention
with a mask tensor (padding, packed documents whose position_ids restart inside a row).

FlexAttention takes the sequence split too, any mask: its queries split like every other op's
sequence and its keys and values are gathered whole for it (the all-gather form, whatever
`cp_comm` says), each piece building its block mask for its own global query positions
(rules/flex_attention.py). A document mask is a mask like any other there, held as a constant or
made from the batch (then the batch tensors it reads are gathered whole for the op).
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.placement import merged_host
from nnscaler_plugins.passes.parallelization import Parallelization
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder
from nnscaler_plugins.rules import op_call
from nnscaler_plugins.rules.attention import SEQUENCE, sequence_split_problem

MODES = ("ring", "allgather", "ulysses")
_SDPA = "aten.scaled_dot_product_attention.default"


def _is_attention(op: OpHandle) -> bool:
    return op.node.op_name == _SDPA or str(op.node.target) == _SDPA


def _is_flex(op: OpHandle) -> bool:
    return str(op.node.target).endswith(".FlexAttentionCall")


def attention_ops(builder: PlanBuilder) -> list[OpHandle]:
    return [op for op in builder.ops if _is_attention(op)]


def flex_ops(builder: PlanBuilder) -> list[OpHandle]:
    """FlexAttention calls: their queries split along the sequence and their keys and values are
    gathered whole for them (rules/flex_attention.py), whatever `cp_comm` says."""
    return [op for op in builder.ops if _is_flex(op)]


def check_context_parallel(builder: PlanBuilder, cp: int, mode: str, balance: bool) -> int:
    """The sequence length every attention shares, after refusing what cp cannot run exactly."""
    if mode not in MODES:
        raise PlanError(f"cp_comm={mode!r}: use one of {', '.join(MODES)}")
    attns = attention_ops(builder)
    flex = flex_ops(builder)
    if not attns and not flex:
        raise PlanError(f"context parallelism found no scaled_dot_product_attention or FlexAttention in "
                        f"{builder.graph.model_class}; cp splits attention's sequence, and attention written as "
                        "matmul, softmax and matmul is not recognized: use attn_implementation='sdpa' (Hugging "
                        "Face), torch.nn.functional.scaled_dot_product_attention or FlexAttention")
    for op in flex:
        if op.signature.is_frozen(op.signature.inputs[0][2]):
            raise PlanError("context parallelism cannot split this FlexAttention's queries: its block mask was made "
                            "from explicit block indices (no mask_mod to build each piece's mask from); build it with "
                            "create_block_mask(mask_mod, ...), or use dp / tp (heads) / a pipeline",
                            op=op.name, where=op.where())
    lengths = set()
    for op in attns:
        call = op_call(builder.graph, op.node)
        why = sequence_split_problem(call)
        if why is not None:
            advice = ("the ring, all-gather and Ulysses kernels draw no dropout masks: train with attention dropout "
                      "0 (model.eval(), or the config's attention dropout set to 0)" if "dropout" in why else
                      "Packed documents (position_ids restarting inside a row) and padding masks are not supported "
                      "under cp; train them with dp/tp, or pad rows to one document each")
            raise PlanError(f"context parallelism cannot split this attention's sequence: {why}; {advice}",
                            op=op.name, where=op.where())
        q, k = call.inputs[0], call.inputs[1]
        lengths.add(q.shape[-2])
        if mode == "ulysses" and (q.shape[-3] % cp or k.shape[-3] % cp):
            raise PlanError(f"cp_comm='ulysses' over cp={cp} devices needs query heads ({q.shape[-3]}) and key/value "
                            f"heads ({k.shape[-3]}) divisible by {cp}; use cp_comm='ring' or a cp of at most "
                            f"{k.shape[-3]} dividing both", op=op.name, where=op.where())
    for op in flex:  # queries split, keys and values gathered whole: no head count to check
        lengths.add(op_call(builder.graph, op.node).inputs[0].shape[-2])
    if len(lengths) != 1:
        raise PlanError(f"context parallelism needs one sequence length for every attention; found {sorted(lengths)}")
    length = lengths.pop()
    need = 2 * cp if balance else cp
    if length % need:
        raise PlanError(f"sequence length {length} is not divisible by {'2 x cp = ' if balance else 'cp = '}{need}"
                        f"{' (causal load balancing holds chunks i and 2cp-1-i)' if balance else ''}; pad the "
                        f"sequence to a multiple of {need}" + ("" if not balance else " or pass balance=False"))
    return length


def _label_of(op: OpHandle, i: int, d: int) -> Optional[str]:
    labs = op.signature.inputs[i] if i < len(op.signature.inputs) else None
    return None if labs is None or d >= len(labs) else labs[d]


def _may_split(op: OpHandle, lab: str) -> bool:
    """Whether the sequence may split op along `lab`: not a frozen dim, and not a sum over it (or a
    label whose pieces talk to each other) unless the op is attention or a loss that averages over
    the pieces itself (cross-entropy's mean: the local sum over the global count of tokens)."""
    sig = op.signature
    if sig.is_frozen(lab):
        return False
    if lab in sig.reduce or lab in sig.comm_labels:
        return _is_attention(op) or (lab in sig.reduce and lab in sig.comm_labels)
    return True


def _candidates(op: OpHandle, i: int, dim: int, blocks: int, base: int) -> list[tuple[str, int]]:
    """(label, block) an op may split the sequence of input i along: the label of its dim, or --
    where the dim is a reshape's merge of rows holding the sequence (batch x sequence, blocks =
    rows x base) and the op unmerges it -- the inner label that carries the sequence again."""
    lab = _label_of(op, i, dim)
    if lab is None:
        return []
    out = []
    for inner, (host, rows) in (getattr(op.signature, "merged", None) or {}).items():
        if host == lab and rows > 1 and blocks == rows * base:
            out.append((inner, base))
    return out + [(lab, blocks)]


def sequence_choices(builder: PlanBuilder, cp: int, length: int, block: int) -> dict[str, Optional[tuple[str, int]]]:
    """The (label, block) each op splits for the sequence (None: it runs whole), found by the walk.

    A value's sequence is tracked as (dim, block count): `block` where the dim is the sequence,
    rows x `block` where a reshape merged rows of it into one dim (the flattened logits of an LM
    head: (b, s, V) -> (b*s, V) holds each row's mirrored pieces in b blocks), so the ops after
    such a merge -- the loss over flattened logits -- still run on the local pieces."""
    graph = builder.graph
    seq_at: dict[str, tuple[int, int]] = {}
    for spec in graph.inputs:
        v = graph.values.get(spec.name)
        meta = None if v is None else v.meta
        if meta is not None and v.kind == "input" and len(meta.shape) >= 2 and meta.shape[1] == length:
            seq_at[spec.name] = (1, block)
    choices: dict[str, Optional[tuple[str, int]]] = {}
    for op in builder.ops:
        sig = op.signature
        candidates = [(SEQUENCE, block)] if _is_attention(op) else []
        for i, name in enumerate(op.node.inputs):
            if name in seq_at:
                for cand in _candidates(op, i, *seq_at[name], block):
                    if cand not in candidates:
                        candidates.append(cand)
        chosen = None
        for lab, blk in candidates:
            if _may_split(op, lab) and op.splittable(lab, cp, blk):
                chosen = (lab, blk)
                break
        choices[op.name] = chosen
        if chosen is None:
            continue
        lab, blk = chosen
        for j, out in enumerate(op.node.outputs):
            labs = sig.outputs[j] if j < len(sig.outputs) else None
            dims = [d for d, l in enumerate(labs or ()) if l == lab]
            host = merged_host(sig, lab, labs)
            if out is None:
                continue
            if len(dims) == 1:
                seq_at[out] = (dims[0], blk)
            elif host is not None and (blk > 0 or blk % 2 == 0):
                seq_at[out] = (host[0], host[1] * blk)
    return choices


def apply_cp(par: Parallelization, cp_comm: str = "ring", balance: Optional[bool] = None,
             tp_choices: Optional[dict[str, Any]] = None) -> dict[str, Optional[tuple[str, int]]]:
    """Context parallelism along the mesh's "cp" axis: the sequence walk (`sequence_choices`), one
    over the whole graph, so every pipeline stage splits the sequence the same way and each
    attention's ring is its own stage's cp devices. Causal load balancing (mirrored 2-block split)
    by default where some attention is causal. Records `cp_comm` in the plan's knobs. Ops tensor
    parallelism splits along the same dim, or whose group-aware piece talks along tp's label and
    cannot also sum over sequence pieces (vocabulary-parallel cross-entropy), keep tp alone
    (`tp_choices`: what `apply_tp` returned). Returns every op's (label, block) or None."""
    builder = par.builder
    n = par.degree("cp")
    tp = par.degree("tp")
    if balance is None:  # FlexAttention's masks are functions: balanced by default, as a causal one needs
        balance = bool(flex_ops(builder)) or any(bool(op_call(builder.graph, op.node).arg(5, "is_causal", False))
                                                  for op in attention_ops(builder))
    length = check_context_parallel(builder, n, str(cp_comm), bool(balance))
    builder.set_knobs(cp_comm=str(cp_comm))
    block = -2 if balance else 1
    choices = sequence_choices(builder, n, length, block) if n > 1 else {op.name: None for op in builder.ops}
    if n > 1 and not any(choices[op.name] for op in attention_ops(builder) + flex_ops(builder)):
        raise PlanError(f"context parallelism could not split the attention's sequence ({length}) {n} ways")
    tp_choices = tp_choices or {}
    if str(cp_comm) == "ulysses":
        for ops, _ in par.segments():
            _check_ulysses_heads(builder, ops, tp_choices, tp, n)
    for op in builder.ops:
        seq, seq_block = choices[op.name] or (None, block)
        t = tp_choices.get(op.name)
        t_label = getattr(t, "label", None)
        sig = op.signature
        if t_label is not None and (seq == t_label or t_label in sig.comm_labels and
                                    (seq in sig.comm_labels or seq in sig.reduce)):
            seq = None
        if seq is not None and n > 1:
            par.split(op, "cp", seq, seq_block)
    return choices


def _check_ulysses_heads(builder: PlanBuilder, ops: list[OpHandle], tp_choices: dict[str, Any], tp: int,
                         cp: int) -> None:
    """Ulysses swaps the sequence split for a head split of what each device holds: where tensor
    parallelism already splits the heads tp ways, heads / tp must divide by cp (refused by size)."""
    for op in ops:
        t = tp_choices.get(op.name)
        labels = op.signature.inputs[0] if op.signature.inputs else None
        if t is None or t.label is None or not _is_attention(op) or not labels or len(labels) < 3 \
                or t.label != labels[-3]:
            continue
        call = op_call(builder.graph, op.node)
        q, k = call.inputs[0].shape[-3], call.inputs[1].shape[-3]
        if (q // tp) % cp or (k // tp) % cp:
            raise PlanError(f"cp_comm='ulysses' over cp={cp} devices with the heads split tp={tp} ways needs query "
                            f"heads / tp ({q} / {tp} = {q // tp}) and key/value heads / tp ({k} / {tp} = {k // tp}) "
                            f"divisible by {cp}; use cp_comm='ring', or a cp x tp dividing both head counts",
                            op=op.name, where=op.where())
