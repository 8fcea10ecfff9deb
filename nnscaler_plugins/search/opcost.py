"""What each op of a graph costs before any plan: FLOPs, bytes moved, and what its backward keeps.

Read once per graph (`OpCosts.of(graph)`) and shared by every plan the simulator or the search
looks at. Numbers are for the whole op; a plan's pieces divide them by the number of pieces along
the labels that cut each tensor (every split label partitions the op's iteration space, so a piece
does 1/num of the FLOPs and reads and writes its chunks only).

Op classes, from the aten overload:
- matmul: the matmul family, convolutions and attention kernels; time from FLOPs.
- memory: element-wise ops, norms, softmax, losses, embeddings, copies; time from bytes.
- view: aliases (view, transpose, expand, split, ...); free, and they share their input's storage.

Saved tensors (activation memory) follow what PyTorch's autograd formulas keep: a matmul keeps the
operands the other operand's gradient needs, a non-linear element-wise op its input (or output), a
softmax its output, a norm its input, dropout its mask (one byte per element), and ops that are
linear in their inputs (add, views, sums, scalings by constants) keep nothing. Saved views keep
their whole base tensor alive, so savings are counted per storage base. The key/value repeats of
grouped-query attention that the lowering folds into the attention call (`lower/grouped_query.py`)
are views here too: the attention keeps the un-repeated heads, as the program runs. For a GPT layer this gives
Korthikanti et al.'s 34·s·b·h + 5·a·s²·b bytes exactly; nothing about transformers is assumed.

Selective recomputation (Korthikanti et al.) drops what the "attention core" keeps: the ops on a
path from a matmul of two activations (scores = q·kᵀ) to the next such matmul (probabilities·v),
both included, which hold much memory for few FLOPs. The rule is structural, so attention written any way is
found, and fused attention (one scaled_dot_product_attention op) has no core to drop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode
from nnscaler_plugins.lower import grouped_query
from nnscaler_plugins.rules import Signature, signature_for

MATMUL = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "addbmm", "einsum", "conv1d", "conv2d",
                    "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
                    "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                    "_scaled_dot_product_flash_attention_for_cpu", "addmv", "mv", "dot", "vdot"})
ATTENTION = frozenset(n for n in MATMUL if "attention" in n)
# Aliases of their (first) input: no work, same storage.
VIEWS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as", "unsqueeze",
                   "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach",
                   "as_strided", "unflatten", "flatten", "narrow", "view_as", "contiguous", "to", "_to_copy",
                   "type_as", "lift_fresh_copy", "movedim", "swapaxes", "mT", "diagonal", "numpy_T", "clone",
                   "dropout_noop", "_assert_tensor_metadata", "sym_size", "_reshape_alias"})
# Views that leave the result non-contiguous (a following reshape or contiguous copies).
STRIDING = frozenset({"transpose", "t", "permute", "expand", "expand_as", "movedim", "swapaxes", "mT",
                      "diagonal", "numpy_T", "as_strided"})
# Ops linear in their tensor inputs: their backward needs nothing saved.
LINEAR = frozenset({"add", "sub", "neg", "sum", "mean", "cat", "stack", "pad", "constant_pad_nd", "cumsum",
                    "flip", "roll", "repeat", "tile", "index_select", "masked_fill", "fill", "zero", "zeros_like",
                    "ones_like", "full_like", "new_ones", "new_zeros", "new_full", "new_empty", "arange", "zeros",
                    "ones", "full", "empty", "scalar_tensor", "eq", "ne", "lt", "le", "gt", "ge", "__and__",
                    "__or__", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "diff",
                    "tril", "triu", "copy", "copy_", "detach_", "sym_numel", "select_scatter", "slice_scatter"})
# Ops whose backward needs their output rather than their input.
SAVES_OUTPUT = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "exp", "tanh", "sigmoid", "relu",
                          "rsqrt", "sqrt", "reciprocal"})
DROPOUT = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
# Losses every training stack computes in fp32 whatever the precision (Hugging Face's loss upcasts the
# logits, Megatron's vocab-parallel cross-entropy and torchtitan's loss take them as float, autocast runs
# them in fp32): their outputs, what they keep for backward and their gradients are 4-byte.
LOSS_FP32 = frozenset({"log_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"})
# Ops that mask attention scores (where / masked_fill with a boolean mask, add with an additive one)
MASKING = frozenset({"where", "masked_fill", "add"})
# Ops that make a mask triangular (a causal mask is built from these, a padding mask is not)
TRIANGULAR = frozenset({"tril", "triu", "arange"})


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


@dataclass(frozen=True)
class TensorUse:
    """One tensor an op reads or writes: its value, element count and labels in the op's signature."""

    value: str
    numel: int
    itemsize: Optional[int]  # bytes per element when fixed by the dtype (bool, ints); None: training dtype
    labels: Optional[tuple[str, ...]]


@dataclass
class OpCost:
    """The whole op, before splitting."""

    name: str
    kind: str  # "matmul" | "memory" | "view"
    flops: float  # forward
    flops_input_grad: float  # backward: gradients of activation inputs
    flops_weight_grad: float  # backward: gradients of parameters
    inputs: list[TensorUse]
    outputs: list[TensorUse]
    needs_grad: bool  # some input requires a gradient: the op has a backward
    saved: list[int]  # indices into inputs (>= 0) or ~index of outputs (< 0) kept for backward
    saved_masks: int = 0  # elements of one-byte masks kept (dropout)
    # `saved` where element-wise kernels are fused by hand (`OpCosts._mark_fused_saves`); None: the same
    saved_fused: Optional[tuple] = None
    core: bool = False  # part of an attention core (dropped by selective recomputation)
    core_causal: bool = False  # the core it belongs to masks its scores (a decoder's causal attention)
    key: tuple = ()  # same key = same cost under the same placement (identical layers share it)
    # element-wise chains fused into one kernel: inputs not read from / outputs not written to memory
    fused_in: frozenset = frozenset()
    fused_out: frozenset = frozenset()
    # matmuls: the GEMM's dims as signature labels, for kernel tables ((label, size) pairs; M, N, K and
    # batch labels); attention kernels: (query-length label, query length, key length, head size, causal)
    gemm: tuple = ()
    attn: tuple = ()
    fp32: bool = False  # computed in fp32 whatever the training precision (LOSS_FP32)

    def saved_uses(self) -> list[TensorUse]:
        return [self.inputs[i] if i >= 0 else self.outputs[~i] for i in self.saved]


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _matmul_flops(op: OpNode, graph: Graph) -> float:
    """2 x multiply-adds, from the output size and the contracted length."""
    name = op.short_name
    metas = [graph.meta(i) for i in op.inputs]
    outs = [graph.values[o].meta for o in op.outputs if o is not None and graph.values[o].meta is not None]
    if not outs or not metas:
        return 0.0
    out = outs[0]
    if name in ATTENTION:
        q, k = metas[0], metas[1]
        # scores and probabilities @ v: 2 matmuls of (L x S x E)
        lq, e = q.shape[-2], q.shape[-1]
        s = k.shape[-2]
        batch = _numel(q.shape[:-2])
        ev = metas[2].shape[-1] if len(metas) > 2 else e
        return 2.0 * batch * lq * s * (e + ev)
    if name.startswith("conv"):
        w = metas[1]
        per_out = _numel(w.shape[1:])  # Cin/groups x kernel
        return 2.0 * out.numel * per_out
    if name in ("linear",):
        return 2.0 * out.numel * metas[0].shape[-1]
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        a = metas[1]
        return 2.0 * out.numel * a.shape[-1]
    if name in ("mm", "bmm", "matmul", "mv", "dot", "vdot"):
        a = metas[0]
        return 2.0 * out.numel * a.shape[-1]
    # einsum and anything else: bound by the largest input times the output's size ratio
    return 2.0 * max(m.numel for m in metas) * max(1, out.numel // max(1, max(m.numel for m in metas)))


def _gemm_dims(op: OpNode, g: Graph, ins: list, outs: list, big: list) -> tuple:
    """(sizes, M, N, K, batch labels) of a matmul from its two big operands' and its output's labels:
    K is contracted (in both operands, not the output), batch in all three, M only in the first
    operand and the output, N only in the second. () when the labels do not say."""
    if len(big) < 2 or not outs or outs[0].labels is None:
        return ()
    a, b = sorted(big)[:2]
    la, lb, lo = ins[a].labels, ins[b].labels, outs[0].labels
    if la is None or lb is None:
        return ()
    sizes: dict[str, int] = {}
    for use in (ins[a], ins[b], outs[0]):
        shape = g.values[use.value].meta.shape
        if len(shape) != len(use.labels):
            return ()
        for label, n in zip(use.labels, shape):
            sizes[label] = int(n)
    sa, sb, so = set(la), set(lb), set(lo)
    k = tuple(x for x in la if x in sb and x not in so)
    batch = tuple(x for x in lo if x in sa and x in sb)
    m = tuple(x for x in lo if x in sa and x not in sb)
    n = tuple(x for x in lo if x in sb and x not in sa)
    if not k:
        return ()
    return tuple(sorted(sizes.items())), m, n, k, batch


def _attention_dims(op: OpNode, g: Graph, ins: list) -> tuple:
    if len(ins) < 2 or ins[0].labels is None:
        return ()
    q, k = g.values[ins[0].value].meta.shape, g.values[ins[1].value].meta.shape
    if len(q) < 2 or len(ins[0].labels) != len(q):
        return ()
    causal = bool(op.kwargs.get("is_causal", op.args[5] if len(op.args) > 5 and isinstance(op.args[5], bool) else False))
    return ins[0].labels[-2], int(q[-2]), int(k[-2]), int(q[-1]), causal


def _itemsize(dtype: torch.dtype) -> Optional[int]:
    """Fixed element size for non-floating dtypes; floating tensors take the training precision."""
    if is_floating(dtype):
        return None
    if dtype == torch.bool:
        return 1
    return torch.empty((), dtype=dtype).element_size()


class OpCosts:
    """Per-op costs of one graph, plus the graph-level facts costs need (storage bases, cores)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.ops: dict[str, OpCost] = {}
        self.signatures: dict[str, Signature] = {}
        self.base: dict[str, str] = {}  # value -> the value owning its storage
        self._contiguous: dict[str, bool] = {}
        # key/value repeats the lowering folds into the attention call (`enable_gqa`): views, no copy
        self._folded = grouped_query.graph_repeats(graph)
        for op in graph.ops:
            sig = signature_for(graph, op)
            self.signatures[op.name] = sig
            self.ops[op.name] = self._cost(op, sig)
        self._mark_cores()
        self._mark_fusion()
        self._mark_fused_saves()

    @classmethod
    def of(cls, graph: Graph) -> "OpCosts":
        cached = getattr(graph, "_nns_op_costs", None)
        if cached is None:
            cached = cls(graph)
            # The graph is plain data made once per capture; caching its costs on it keeps identical
            # work from being repeated by every simulate/search call on the same graph.
            object.__setattr__(graph, "_nns_op_costs", cached)
        return cached

    # -- one op ---------------------------------------------------------------------------------------
    def _uses(self, names, labels_list) -> list[TensorUse]:
        out = []
        for i, name in enumerate(names):
            if name is None:
                continue
            meta = self.graph.values[name].meta
            if meta is None:
                continue
            labels = labels_list[i] if i < len(labels_list) else None
            out.append(TensorUse(name, meta.numel, _itemsize(meta.dtype), labels))
        return out

    def _cost(self, op: OpNode, sig: Signature) -> OpCost:
        g = self.graph
        name = op.short_name
        ins = self._uses(op.inputs, list(sig.inputs))
        outs = self._uses(op.outputs, list(sig.outputs))
        needs_grad = op.grad_enabled and any(g.meta(i).requires_grad for i in op.inputs if g.values[i].meta is not None)
        shapes = tuple(tuple(g.values[v].meta.shape) if v is not None and g.values[v].meta is not None else None
                       for v in list(op.inputs) + list(op.outputs))
        key = (op.op_name, shapes, tuple((u.itemsize, u.labels) for u in ins),
               tuple((u.itemsize, u.labels) for u in outs), _arg_key(op), needs_grad,
               tuple(g.values[i].kind == "param" for i in op.inputs))
        self._track_storage(op, name)
        if name in VIEWS and not self._copies(op, name):
            return OpCost(op.name, "view", 0.0, 0.0, 0.0, ins, outs, needs_grad, [], key=key)
        if name in MATMUL:
            flops = _matmul_flops(op, g)
            grads = [g.meta(i).requires_grad for i in op.inputs]
            kinds = [g.values[i].kind for i in op.inputs]
            # a bias (1-D or broadcast add) has a cheap gradient; the two big operands carry the FLOPs
            big = sorted(range(len(ins)), key=lambda i: -ins[i].numel)[:2]
            w_grad = sum(flops for i in big if grads[i] and kinds[i] == "param") if op.grad_enabled else 0.0
            a_grad = sum(flops for i in big if grads[i] and kinds[i] != "param") if op.grad_enabled else 0.0
            saved = [i for i in big if g.values[ins[i].value].kind not in ("param",)
                     and any(grads[j] for j in big if j != i)] if needs_grad else []
            if name in ATTENTION and needs_grad:
                saved = list(range(min(3, len(ins)))) + [~0]
            return OpCost(op.name, "matmul", flops, a_grad, w_grad, ins, outs, needs_grad, saved, key=key,
                          gemm=_gemm_dims(op, g, ins, outs, big) if name not in ATTENTION else (),
                          attn=_attention_dims(op, g, ins) if name in ATTENTION else ())
        saved: list[int] = []
        masks = 0
        if needs_grad and name not in VIEWS:  # copies (clone, casts, reshapes that copy) keep nothing
            float_ins = [i for i, u in enumerate(ins) if u.itemsize is None and g.values[u.value].kind not in ("param", "buffer", "constant")]
            if name in DROPOUT:
                masks = outs[0].numel if outs else 0
            elif name in SAVES_OUTPUT:
                saved = [~0] if outs else []
            elif name in LINEAR:
                saved = []
            elif name in ("mul", "div", "pow", "maximum", "minimum", "atan2"):
                # the gradient of each input that needs one reads the other inputs (x * y keeps y for
                # x's gradient and x for y's); a product with a constant keeps nothing
                needing = [i for i, u in enumerate(ins) if g.meta(u.value).requires_grad]
                saved = [j for j in float_ins if any(i != j for i in needing)]
                if name == "pow":
                    saved = float_ins[:1]
            elif name == "where":
                saved = [0] if ins else []
            elif name in ("embedding",):
                saved = [1] if len(ins) > 1 else []
            elif name in ("layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm",
                          "native_batch_norm", "instance_norm", "_fused_rms_norm"):
                saved = float_ins[:1]
            elif name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"):
                saved = float_ins[:1] + [i for i, u in enumerate(ins) if u.itemsize is not None]
            else:
                saved = float_ins  # an op with no known formula: assume it keeps its activation inputs
        return OpCost(op.name, "memory", 0.0, 0.0, 0.0, ins, outs, needs_grad, saved, masks, key=key,
                      fp32=name in LOSS_FP32)

    # -- storage ----------------------------------------------------------------------------------------
    def _copies(self, op: OpNode, name: str) -> bool:
        """A view-like op that allocates: reshape/contiguous of a non-contiguous input, clone, dtype casts."""
        src = op.inputs[0] if op.inputs else None
        if op.name in self._folded:
            return False
        if name == "clone":
            return True
        if name in ("to", "_to_copy", "type_as"):
            outs = [o for o in op.outputs if o is not None]
            if src is None or not outs:
                return False
            return self.graph.meta(src).dtype != self.graph.meta(outs[0]).dtype
        if name in ("reshape", "contiguous", "_reshape_alias", "flatten", "unflatten"):
            return src is not None and not self._contiguous.get(src, True)
        return False

    def _track_storage(self, op: OpNode, name: str) -> None:
        outs = [o for o in op.outputs if o is not None]
        src = op.inputs[0] if op.inputs else None
        if name in VIEWS and src is not None and not self._copies(op, name):
            base = self.base.get(src, src)
            contiguous = self._contiguous.get(src, True)
            if name in STRIDING or (name in ("split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow")
                                    and _dim_arg(op) not in (0, None)):
                contiguous = False
            for o in outs:
                self.base[o] = base
                self._contiguous[o] = contiguous
        else:
            for o in outs:
                self.base[o] = o
                self._contiguous[o] = True

    def storage(self, value: str) -> str:
        return self.base.get(value, value)

    # -- fusion ----------------------------------------------------------------------------------------------
    def _mark_fusion(self) -> None:
        """Mark tensors that a chain of fusable ops passes in registers (one consumer, not saved)."""
        g = self.graph
        consumers: dict[str, list[OpNode]] = {}
        for op in g.ops:
            for i in op.inputs:
                consumers.setdefault(i, []).append(op)
        for o in g.outputs:
            if o is not None:
                consumers.setdefault(o, []).append(None)  # model outputs must be written
        saved = set()
        for c in self.ops.values():
            for u in c.saved_uses():
                saved.add(self.storage(u.value))
        fused_in: dict[str, set] = {}
        fused_out: dict[str, set] = {}

        def real_consumer(v: str, depth: int = 0) -> Optional[tuple[OpNode, str]]:
            users = consumers.get(v, [])
            if len(users) != 1 or users[0] is None or depth > 8:
                return None
            u = users[0]
            if self.ops[u.name].kind == "view":
                outs = [o for o in u.outputs if o is not None]
                return real_consumer(outs[0], depth + 1) if len(outs) == 1 else None
            return u, v

        for op in g.ops:
            c = self.ops[op.name]
            if not _fusable(op, c):
                continue
            for j, o in enumerate(x for x in op.outputs if x is not None):
                hit = real_consumer(o)
                if hit is None:
                    continue
                q, v = hit
                qc = self.ops[q.name]
                if not _fusable(q, qc):
                    continue
                idx = next((i for i, u in enumerate(qc.inputs) if u.value == v), None)
                if idx is None:
                    continue
                fused_in.setdefault(q.name, set()).add(idx)
                if self.storage(o) not in saved:
                    fused_out.setdefault(op.name, set()).add(j)
        for name in set(fused_in) | set(fused_out):
            c = self.ops[name]
            c.fused_in = frozenset(fused_in.get(name, ()))
            c.fused_out = frozenset(fused_out.get(name, ()))
            c.key = c.key + (tuple(sorted(c.fused_in)), tuple(sorted(c.fused_out)))

    def _mark_fused_saves(self) -> None:
        """What the backward keeps where element-wise kernels are fused by hand (`Efficiency.fused_elementwise`:
        Transformer Engine's and Megatron's RMSNorm, SwiGLU, bias-GeLU kernels): such a kernel's backward
        recomputes the intermediates of its chain from the chain's inputs, so it keeps a tensor only when
        that cannot be done from tensors the backward keeps anyway. Traced eagerly, an RMSNorm keeps its
        input and its normalized copy (the weight's product keeps it) and a SwiGLU keeps the gate's
        activation beside the gate and up projections; fused, the normalized copy and the activation are
        recomputed from the input and the inverse RMS, and from the gate. Only tensors an element-wise op
        keeps are dropped: a matmul's or an attention kernel's operands are read from memory by a kernel
        of their own. Ops whose saves change get `saved_fused`, read by the cost model on such stacks."""
        g = self.graph
        producer: dict[str, str] = {}  # storage -> the op that wrote it (not a view of it)
        for op in g.ops:
            if self.ops[op.name].kind != "view":
                for o in op.outputs:
                    if o is not None:
                        producer[self.storage(o)] = op.name
        kept: set[str] = set()  # storages the backward keeps, in program order so far

        def recomputable(base: str, depth: int) -> bool:
            """Whether `base` is an element-wise result of kept tensors (through at most 8 fused ops)."""
            name = producer.get(base)
            if name is None or depth > 8:
                return False
            op, c = g.op(name), self.ops[name]
            if not _fusable(op, c):
                return False
            for u in c.inputs:
                if g.values[u.value].kind in ("param", "buffer", "constant") or u.itemsize is not None:
                    continue  # weights are held anyway; integer and boolean inputs are not activations
                b = self.storage(u.value)
                if b not in kept and not recomputable(b, depth + 1):
                    return False
            return True

        for op in g.ops:
            c = self.ops[op.name]
            if not c.saved:
                continue
            fused = _fusable(op, c)
            mine = []
            for i in c.saved:
                u = c.inputs[i] if i >= 0 else c.outputs[~i]
                base = self.storage(u.value)
                if fused and u.itemsize is None and base not in kept and recomputable(base, 0):
                    continue
                mine.append(i)
                kept.add(base)
            if len(mine) != len(c.saved):
                c.saved_fused = tuple(mine)
                c.key = c.key + (("saved fused",) + c.saved_fused,)

    # -- selective recomputation -------------------------------------------------------------------------
    def _act_matmul(self, op: OpNode) -> bool:
        """A matmul of two activations (no parameter operand): attention scores or probabilities @ v."""
        c = self.ops[op.name]
        if c.kind != "matmul" or op.short_name in ATTENTION:
            return False
        kinds = [self.graph.values[i].kind for i in op.inputs]
        return len(op.inputs) >= 2 and all(k not in ("param", "buffer", "constant") for k in kinds[:2]) \
            and "param" not in kinds

    def _triangular(self, op: OpNode, scores: OpNode, producer: dict) -> bool:
        """Whether `op` masks the scores with a mask built from a triangle or positions (causal)."""
        seen, todo = set(), [i for i in op.inputs if i not in scores.outputs]
        while todo and len(seen) < 64:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            src = producer.get(v)
            if src is None:
                continue
            if src.short_name in TRIANGULAR:
                return True
            if self.ops[src.name].kind != "matmul":
                todo.extend(src.inputs)
        return False

    def _mark_cores(self) -> None:
        g = self.graph
        producer = {o: op for op in g.ops for o in op.outputs if o is not None}
        consumers: dict[str, list[OpNode]] = {}
        for op in g.ops:
            for i in op.inputs:
                consumers.setdefault(i, []).append(op)
        starts = [op for op in g.ops if self._act_matmul(op)]
        start_names = {op.name for op in starts}
        for start in starts:
            # forward from the scores through parameter-free, non-matmul ops; the core is what lies
            # on a path to a closing activation matmul
            reach: dict[str, OpNode] = {}
            order: list[OpNode] = []
            ends: list[str] = []
            frontier = [o for o in start.outputs if o is not None]
            while frontier and len(reach) < 256:
                nxt = []
                for v in frontier:
                    for c in consumers.get(v, ()):
                        if c.name in start_names:
                            ends.append(c.name)
                            continue
                        if c.name in reach or self.ops[c.name].kind == "matmul" \
                                or any(g.values[i].kind == "param" for i in c.inputs):
                            continue
                        reach[c.name] = c
                        order.append(c)
                        nxt.extend(o for o in c.outputs if o is not None)
                frontier = nxt
            if not ends:
                continue
            leads: set[str] = set()
            for c in reversed(order):
                outs = [o for o in c.outputs if o is not None]
                if any(x.name in start_names or x.name in leads for o in outs for x in consumers.get(o, ())):
                    leads.add(c.name)
            # the closing matmul (probabilities @ v) belongs too: it is what keeps the probabilities
            causal = any(reach[n].short_name in MASKING and self._triangular(reach[n], start, producer)
                         for n in leads)
            for n in [start.name] + sorted(leads) + ends:
                self.ops[n].core = True
                self.ops[n].core_causal = causal


NOT_FUSABLE = frozenset({"embedding", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "index", "index_select",
                         "gather", "scatter", "scatter_add", "cat", "stack", "cumsum", "arange", "zeros", "ones", "full",
                         "empty", "new_ones", "new_zeros", "scalar_tensor", "embedding_dense_backward", "sort", "topk"})


def _fusable(op: OpNode, c: "OpCost") -> bool:
    """An element-wise-shaped memory-bound op (its output as large as its largest input): what a fusing
    compiler or a hand-fused kernel (bias-GeLU, scale-mask-softmax, bias-dropout-add) runs as one kernel."""
    if c.kind != "memory" or op.short_name in NOT_FUSABLE or not c.outputs or not c.inputs:
        return False
    return c.outputs[0].numel >= max(u.numel for u in c.inputs)


def _dim_arg(op: OpNode) -> Optional[int]:
    """The dim a split/slice/select works on (None when unknown); negative dims stay negative."""
    name = op.short_name
    if name in ("split", "split_with_sizes", "chunk"):
        d = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)
    elif name in ("slice", "select", "narrow", "unbind"):
        d = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
    else:
        return None
    return d if isinstance(d, int) else None


def _arg_key(op: OpNode) -> str:
    """Non-tensor arguments, so that ops with equal shapes but different arguments do not share costs."""
    parts = []
    for a in list(op.args) + list(op.kwargs.values()):
        if isinstance(a, (int, float, bool, str, type(None))):
            parts.append(repr(a))
        elif isinstance(a, (list, tuple)):
            parts.append(repr([x for x in a if isinstance(x, (int, float, bool, str, type(None)))]))
    return "|".join(parts)
