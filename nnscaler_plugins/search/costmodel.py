"""The cost model: time and memory of placed ops, of the communication between them, of model states.

Compute (per op and piece): a roofline, t = max(FLOPs / (peak x matmul efficiency),
bytes / (memory bandwidth x memory efficiency)) + a fixed launch cost, with FLOPs and bytes from
`opcost` divided among the pieces. Backward is 2x the forward FLOPs of a matmul (input and
weight gradients, split for zero-bubble schedules) and 2x the bytes of a memory-bound op.
A profiling mode (`profile=OpProfiler(...)`) replaces the formula by times measured on the device
at hand.

Communication: the layout each producer leaves a tensor in is compared with the layout each
consumer needs; the cheapest collective sequence (`resharding.plan`) is priced with the alpha-beta
model of `network`, and its backward is the dual sequence (all-gather <-> chunk, reduce-scatter <->
all-gather, all-reduce <-> identity, all-to-all <-> all-to-all). An input that the pieces of a split
op all read whole comes back with partial gradients: an all-reduce in backward (for parameters,
once per step in the gradient reducer, together with data parallelism).

Memory: model states per ZeRO stage (`Training`), activations as the storage bases the backward keeps
(see `opcost`), divided among pieces like everything else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.lower.resharding import COMMUNICATING, Step
from nnscaler_plugins.lower.resharding import plan as plan_reshard
from nnscaler_plugins.search.cluster import ClusterSpec
from nnscaler_plugins.search.layouts import Placement, op_layouts
from nnscaler_plugins.search.network import Network, Span, span_of
from nnscaler_plugins.search.opcost import OpCost, OpCosts

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# "op": per-op selective checkpointing as torchtitan runs it (each layer recomputed in backward except the
# outputs of every other weight matmul, of attention kernels and of reduce-scatters); priced for published
# runs of that stack, not run by this runtime
RECOMPUTE = ("none", "selective", "full", "op")
BUCKET_BYTES = 25 * 1024 ** 2  # gradient reducer bucket (as DDP's default)


# torch.compile (the plan's compile knob) is priced through the efficiency model, as every other software
# fact: a compiled program runs chains of element-wise ops as one kernel (`Efficiency.fused_elementwise`),
# so the intermediate tensors of a chain are neither written nor read back and an op wholly inside a chain
# launches no kernel of its own. The presets' stacks describe this runtime's generated code, which runs
# one kernel per op unless compiled. Only on clusters with a GPU kernel table: the local CPU preset
# measures eager PyTorch, and inductor's CPU code is not what it measured.
# Passes over a float8 product's operand bytes its casts take (torchao's dynamic scaling: an amax
# read, then a read and a half-size write): about 1.5 reads' worth on top of the product's own.
FP8_CAST_PASSES = 1.5
# Compiled, an activation's amax is a reduction epilogue of the element-wise kernel that produced it
# (a norm, an activation function, the gradient of the op after the product), as inductor fuses
# torchao's casts: its separate read goes, the cast's read and half-size write stay. A weight's
# cast has no producer in the step to ride on (the optimizer wrote it): it keeps every pass.
FP8_CAST_PASSES_FUSED = FP8_CAST_PASSES - 1.0


def compiles_faster(cluster: ClusterSpec) -> bool:
    """Whether compile=True can price faster on `cluster`: a GPU kernel table (the presets), and a stack
    that does not fuse element-wise chains already (this runtime's eager code, eager PyTorch)."""
    return cluster.kernels is not None and not cluster.efficiency.fused_elementwise


def supports_fp8(cluster: ClusterSpec) -> bool:
    """Whether `cluster`'s devices multiply in float8 (an fp8 peak in its spec: H100, H200)."""
    return "fp8" in cluster.peak_flops


@dataclass(frozen=True)
class Training:
    """How a plan trains, as far as costs go: precision, ZeRO stage, recomputation, sequence parallelism.

    Model states per parameter with Adam: the weights in the training dtype, gradients accumulated
    in fp32 (Megatron's main gradients: 4 bytes; 2 with `grad_bytes=2` as in the ZeRO paper's 16
    bytes), fp32 master weights when training in reduced precision, and Adam's two fp32 moments.
    ZeRO stage 1 shards the optimizer states (master weights and moments) over the data-parallel
    group, stage 2 also the gradients, stage 3 also the weights.
    """

    dtype: str = "bf16"
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    grad_bytes: int = 4
    optimizer_bytes: int = 8
    # precision="fp8": the linears (op names) whose products run in float8 (dtype stays bf16: weights,
    # activations and the other ops are bf16); priced at the cluster's fp8 peak where it has one
    fp8_ops: frozenset = frozenset()
    # the weights (parameter values) ZeRO-3 all-gathers in float8 (the plan's fp8_all_gather): 1 byte
    # an element on the wire instead of `param_bytes`
    fp8_gathered: frozenset = frozenset()
    compiled: bool = False  # the plan's compile knob: element-wise chains fused on GPU stacks (compiles_faster)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE} (got {self.recompute!r})")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3 (got {self.zero!r})")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown training dtype {self.dtype!r}; one of {sorted(DTYPE_BYTES)}")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def master_bytes(self) -> int:
        return 0 if self.dtype in ("fp32", "tf32") else 4

    def state_bytes(self, params: float, shard: int) -> dict[str, float]:
        """Bytes of weights, gradients and optimizer states for `params` parameters, ZeRO over `shard`."""
        shard = max(1, shard)
        z = self.zero
        return {"params": params * self.param_bytes / (shard if z >= 3 else 1),
                "grads": params * self.grad_bytes / (shard if z >= 2 else 1),
                "optimizer": params * (self.master_bytes + self.optimizer_bytes) / (shard if z >= 1 else 1)}

    def to_json(self) -> dict:
        out = {"dtype": self.dtype, "zero": self.zero, "recompute": self.recompute,
               "sequence_parallel": self.sequence_parallel, "grad_bytes": self.grad_bytes}
        if self.fp8_ops:
            out["fp8_linears"] = len(self.fp8_ops)
        if self.fp8_gathered:
            out["fp8_all_gather"] = len(self.fp8_gathered)
        if self.compiled:
            out["compiled"] = True
        return out

    @classmethod
    def from_options(cls, options: Mapping[str, Any], cluster: ClusterSpec) -> "Training":
        rec = options.get("recompute") or "none"
        if rec is True:
            rec = "full"
        if rec is False:
            rec = "none"
        dtype = str(options.get("precision") or options.get("dtype") or cluster.dtype)
        if dtype == "fp8":  # bf16 training; its linears' float8 products are `fp8_ops`
            dtype = "bf16"
        return cls(dtype=dtype, zero=int(options.get("zero", 0) or 0), recompute=str(rec),
                   sequence_parallel=bool(options.get("sequence_parallel", False)),
                   grad_bytes=int(options.get("grad_bytes", 4 if dtype not in ("fp32", "tf32") else 4)),
                   fp8_ops=frozenset(options.get("fp8_ops", ())), compiled=bool(options.get("compile", False)))


@dataclass(frozen=True)
class OpTime:
    fwd: float
    bwd_input: float
    bwd_weight: float
    flops: float = 0.0  # forward FLOPs of this piece (for utilisation figures)

    @property
    def bwd(self) -> float:
        return self.bwd_input + self.bwd_weight


@dataclass(frozen=True)
class _StepCost:
    """Hashable cost function for `resharding.plan`'s path search (one representative link)."""

    alpha: float
    beta: float
    itemsize: int

    def __call__(self, step: Step) -> float:
        if step.kind not in COMMUNICATING:
            return 1e-9
        steps = 2 * (step.group_size - 1) if step.kind == "all-reduce" else max(1, step.group_size - 1)
        return steps * self.alpha + step.elements * self.itemsize / self.beta


def _full_bytes(step: Step, itemsize: int) -> float:
    """The whole tensor a collective step moves, from the per-device traffic `Step.elements` counts."""
    k = max(step.group_size, 1)
    e = step.elements * itemsize
    if step.kind == "all-gather":
        return e * k / max(k - 1, 1)
    if step.kind in ("all-reduce",):
        return e * k / max(2 * (k - 1), 1)
    if step.kind in ("reduce-scatter",):
        return e * k / max(k - 1, 1)
    if step.kind == "all-to-all":
        return e * k * k / max(k - 1, 1)
    return e


DUAL = {"all-gather": None, "all-reduce": None, "reduce-scatter": "all-gather", "chunk": "all-gather",
        "all-to-all": "all-to-all", "permute": "permute", "send": "send", "value-mask": None}


class CostModel:
    """Costs on one cluster for one graph; caches everything keyed by op shapes, so the identical
    layers of a model cost one computation."""

    def __init__(self, graph: Graph, cluster: ClusterSpec, profiler: Optional["Any"] = None):
        self.graph = graph
        self.cluster = cluster
        self.costs = OpCosts.of(graph)
        self.net = Network(cluster)
        self.profiler = profiler
        eff = cluster.efficiency
        self._mm_rate = {}
        self._mem_rate = cluster.memory_bandwidth * eff.memory
        self._overhead = eff.op_overhead_s
        self._time: dict = {}
        self._grad_inputs: dict = {}
        self._lay: dict = {}
        self._reshard: dict = {}
        self._reshard_direct: dict = {}
        self._spans: dict = {}
        self._allreduce: dict = {}
        self._kernels = cluster.kernels
        if self._kernels is not None:  # streaming kernels (the optimizer step) at the table's bandwidth fraction
            self._mem_rate = cluster.memory_bandwidth * self._kernels.memory_fraction * eff.sustained

    def matmul_rate(self, dtype: str) -> float:
        r = self._mm_rate.get(dtype)
        if r is None:
            r = self._mm_rate[dtype] = self.cluster.flops(dtype) * self.cluster.efficiency.matmul
        return r

    # -- compute ----------------------------------------------------------------------------------------
    def _table_mem_rate(self, nbytes: float) -> float:
        return self.cluster.memory_bandwidth * max(self._kernels.memory_efficiency(nbytes), 1e-3) * \
            self.cluster.efficiency.sustained

    def _fused_core_time(self, c: OpCost, p: Placement, dtype: str, shard: int) -> Optional[OpTime]:
        """An op of an attention core on a stack that fuses the core into one flash kernel: its two
        matmuls at the flash table's efficiency (sequence length = the scores' rows, head size = the
        smaller of the other two dims), its element-wise ops free (inside the kernel). None when the
        device has no flash kernel or the matmul's dims are unknown."""
        if c.kind != "matmul":
            return OpTime(0.0, 0.0, 0.0)
        if not c.gemm:
            return None
        sizes, ml, nl, kl, bl = c.gemm
        size, counts = dict(sizes), p.label_counts()

        def local(labels) -> float:
            out = 1.0
            for x in labels:
                out *= size[x] / counts.get(x, 1)
            return out

        seq, hd = local(ml) / shard, min(local(nl), local(kl))
        eff = self.cluster.efficiency
        f = self._kernels.attention_efficiency(seq, hd, False, c.core_causal, eff.attention_kernel)
        if f is None:
            return None
        b = self._kernels.attention_efficiency(seq, hd, True, c.core_causal, eff.attention_kernel)
        peak = self.cluster.flops(dtype) * eff.sustained * (2.0 if c.core_causal else 1.0)
        flops = c.flops / (p.pieces * shard)
        oh = self._overhead / 2  # two matmuls, one kernel
        return OpTime(flops / (peak * f) + oh, c.flops_input_grad / (p.pieces * shard) / (peak * b) + oh
                      if c.flops_input_grad else 0.0, 0.0, flops)

    def _table_rates(self, c: OpCost, p: Placement, dtype: str, shard: int) -> tuple[float, float, float]:
        """FLOP/s of a matmul piece's forward, input-gradient and weight-gradient kernels, from the
        cluster's kernel table at the piece's own GEMM shape (or flash-attention lengths)."""
        tbl, eff = self._kernels, self.cluster.efficiency
        peak = self.cluster.flops(dtype) * eff.sustained
        counts = p.label_counts()
        if c.attn:
            label, sq, sk, hd, causal = c.attn
            seq = max(1.0, sq / counts.get(label, 1))
            f = tbl.attention_efficiency(seq, hd, False, causal, eff.attention_kernel)
            if f is not None:
                b = tbl.attention_efficiency(seq, hd, True, causal, eff.attention_kernel)
                # the FLOPs are counted over the whole score matrix; a causal kernel computes half of it
                scale = 2.0 if causal else 1.0
                return peak * f * scale, peak * b * scale, peak * b * scale
            # no flash kernel on this device: the scores and the weighted values as two batched matmuls
            e = tbl.matmul_efficiency(seq, sk, hd, 1, dtype)
            return peak * e, peak * e, peak * e
        if not c.gemm:
            side = max(1.0, (c.flops / max(p.pieces * shard, 1) / 2) ** (1 / 3))
            e = tbl.matmul_efficiency(side, side, side, 1, dtype)
            return peak * e, peak * e, peak * e
        sizes, ml, nl, kl, bl = c.gemm
        size = dict(sizes)

        def local(labels) -> float:
            out = 1.0
            for x in labels:
                out *= size[x] / counts.get(x, 1)
            return out

        m, n, k, batch = local(ml) / shard, local(nl), local(kl), local(bl)
        fwd = tbl.matmul_efficiency(m, n, k, batch, dtype)  # Y = X W: m x n, contracting k
        bi = tbl.matmul_efficiency(m, k, n, batch, dtype)  # dX = dY W^T: m x k, contracting n
        bw = tbl.matmul_efficiency(k, n, m * batch, 1, dtype)  # dW = X^T dY: k x n, contracting the tokens
        return peak * max(fwd, 1e-3), peak * max(bi, 1e-3), peak * max(bw, 1e-3)

    @staticmethod
    def operand_bytes(c: OpCost, p: Placement, itemsize: int, shard: int) -> tuple[float, float, float]:
        """Local bytes of a product's activation input X, its weight W and its output Y (one piece;
        `shard` divides the activations, as sequence parallelism of a replicated op does)."""
        counts = p.label_counts()

        def size(u) -> float:
            return u.numel * (u.itemsize or itemsize) / math.prod(counts.get(l, 1) for l in (u.labels or ()))

        x = size(c.inputs[0]) / shard if c.inputs else 0.0
        w = size(c.inputs[1]) if len(c.inputs) > 1 else 0.0
        return x, w, sum(size(u) for u in c.outputs) / shard

    def _weight_of(self, name: str) -> Optional[str]:
        """The value a product reads as its weight (its second input), None for a one-input op."""
        inputs = self.graph.op(name).inputs
        return inputs[1] if len(inputs) > 1 else None

    @staticmethod
    def _inside_chain(c: OpCost) -> bool:
        """Whether every tensor `c` reads and writes passes inside a fused element-wise chain."""
        return (bool(c.inputs) and len(c.fused_in) == len(c.inputs) and bool(c.outputs)
                and len(c.fused_out) == len(c.outputs))

    def _local_bytes(self, c: OpCost, p: Placement, itemsize: int, fuse: bool) -> float:
        """Bytes one piece of `c` reads and writes; with `fuse`, not those it passes inside a fused
        element-wise chain."""
        counts = p.label_counts()
        total = 0.0
        for i, u in enumerate(list(c.inputs) + list(c.outputs)):
            if fuse and ((i < len(c.inputs) and i in c.fused_in) or
                         (i >= len(c.inputs) and i - len(c.inputs) in c.fused_out)):
                continue
            div = 1
            for l in u.labels or ():
                div *= counts.get(l, 1)
            total += u.numel * (u.itemsize or itemsize) / div
        return total

    def op_time(self, name: str, p: Placement, training: Training, shard: int = 1) -> OpTime:
        """Compute time of one piece of op `name` under placement `p` (every piece takes the same);
        `shard` divides the work further (sequence parallelism of a replicated op)."""
        c = self.costs.ops[name]
        if c.kind == "view":
            v = self.cluster.efficiency.view_overhead_s
            return OpTime(v, v if c.needs_grad else 0.0, 0.0)
        f8 = name in training.fp8_ops and "fp8" in self.cluster.peak_flops
        compiled = training.compiled and compiles_faster(self.cluster)
        fuse = compiled or self.cluster.efficiency.fused_elementwise
        # a weight ZeRO-3 gathers in float8 reaches the product already cast (each replica cast its
        # chunk before the gather): the product casts neither it nor, in backward, its transpose
        pre_cast = f8 and training.zero >= 3 and self._weight_of(name) in training.fp8_gathered
        key = (c.key, p.splits, p.blocks, training.dtype, shard, f8, fuse, pre_cast)
        t = self._time.get(key)
        if t is not None:
            return t
        if self.profiler is not None:
            t = self.profiler.time(self, name, p, training, shard)
            if t is not None:
                self._time[key] = t
                return t
        if c.core and self._kernels is not None and self.cluster.efficiency.fused_attention:
            t = self._fused_core_time(c, p, training.dtype, shard)
            if t is not None:
                self._time[key] = t
                return t
        pieces = p.pieces * shard
        isz = max(4, training.act_bytes) if c.fp32 else training.act_bytes
        nbytes = self._local_bytes(c, p, isz, fuse) / shard
        oh = self._overhead
        if fuse and c.kind != "matmul" and self._inside_chain(c):
            oh = 0.0  # runs inside its chain's one kernel: no launch of its own
        mem_rate = self._mem_rate if self._kernels is None else self._table_mem_rate(nbytes)
        if c.kind == "matmul":
            flops = c.flops / pieces
            mm = "fp8" if f8 else training.dtype
            if self._kernels is None:
                rf = ri = rw = self.matmul_rate(mm)
            else:
                rf, ri, rw = self._table_rates(c, p, mm, shard)
            # float8: each product first casts its two operands (read bf16, find the scale, write
            # float8): FP8_CAST_PASSES passes over the operands' bytes, as memory-bound kernels. The
            # operands: X and W forward, dY and W for dX, X and dY for dW (not the product's output);
            # W not at all when it arrives in float8 (`pre_cast`)
            cf = ci = cw = 0.0
            if f8:
                x, w, y = self.operand_bytes(c, p, isz, shard)
                w = 0.0 if pre_cast else w
                act = FP8_CAST_PASSES_FUSED if fuse else FP8_CAST_PASSES  # activations: X forward, dY backward
                cf, ci, cw = ((act * a + FP8_CAST_PASSES * b) / mem_rate for a, b in ((x, w), (y, w), (x + y, 0.0)))
            fwd = max(flops / rf, nbytes / mem_rate) + oh + cf
            bi = max(c.flops_input_grad / pieces / ri, nbytes / mem_rate) + oh + ci if c.flops_input_grad else 0.0
            bw = max(c.flops_weight_grad / pieces / rw, nbytes / mem_rate) + oh + cw if c.flops_weight_grad else 0.0
            t = OpTime(fwd, bi, bw, flops)
        else:
            name_ = self.graph.op(name).short_name
            if name_ in ("cross_entropy_loss", "nll_loss", "log_softmax", "_log_softmax"):
                # softmax over the logits: read, write probabilities, read them again for the loss
                logits = max((u for u in c.inputs if u.itemsize is None), key=lambda u: u.numel, default=None)
                if logits is not None:
                    div = 1
                    counts = p.label_counts()
                    for l in logits.labels or ():
                        div *= counts.get(l, 1)
                    nbytes = max(nbytes, 3 * logits.numel * isz / div / shard)
            if self._kernels is not None:
                mem_rate = self._table_mem_rate(nbytes)
            fwd = nbytes / mem_rate + oh
            bwd = 2 * nbytes / mem_rate + oh if c.needs_grad else 0.0
            if name_ == "embedding" and c.needs_grad and c.inputs:
                # the gradient of the table is dense: zeroed and accumulated into at every step
                table = c.inputs[0]
                div = 1
                counts = p.label_counts()
                for l in table.labels or ():
                    div *= counts.get(l, 1)
                bwd += table.numel * training.grad_bytes / div / mem_rate
                t = OpTime(fwd, 0.0, bwd)
            else:
                t = OpTime(fwd, bwd, 0.0)
        self._time[key] = t
        return t

    # -- layouts and communication -----------------------------------------------------------------------
    def layouts(self, name: str, p: Placement) -> tuple[tuple, tuple, tuple]:
        """Layouts of op `name`'s inputs and outputs on its devices (`p.devices`), and per input the
        number of pieces over which its gradient is partial."""
        c = self.costs.ops[name]
        key = (c.key, p)
        out = self._lay.get(key)
        if out is None:
            g = self.graph
            op = g.op(name)
            sig = self.costs.signatures[name]
            shapes_in = tuple(tuple(g.meta(v).shape) if g.values[v].meta is not None else () for v in op.inputs)
            shapes_out = tuple(tuple(g.meta(v).shape) if v is not None and g.values[v].meta is not None else None
                               for v in op.outputs)
            labels_in = tuple(sig.inputs[i] if i < len(sig.inputs) else None for i in range(len(op.inputs)))
            labels_out = tuple(sig.outputs[j] if j < len(sig.outputs) else None for j in range(len(op.outputs)))
            ins, outs, grads = op_layouts(shapes_in, tuple(s if s is not None else () for s in shapes_out), sig, p,
                                          labels_in, labels_out)
            outs = tuple(o if s is not None else None for o, s in zip(outs, shapes_out))
            out = self._lay[key] = (ins, outs, grads)
        return out

    def span(self, devices: Sequence[int]) -> Span:
        """How the global `devices` lie on the cluster (nodes touched, members per node)."""
        return span_of(self.cluster, devices)

    _span = span

    @property
    def streaming_rate(self) -> float:
        """Bytes/s a streaming kernel (the optimizer step's element-wise update) reaches on this device."""
        return self._mem_rate

    def replica_span(self, members: Sequence[int], unit: int, dp: int, to_global=lambda d: d) -> Span:
        """Span of unit devices `members` across all `dp` replicas of the unit (a data-parallel group)."""
        key = (tuple(members), unit, dp)
        hit = self._spans.get(key)
        if hit is None:
            hit = self._spans[key] = span_of(self.cluster, [to_global(m + r * unit) for r in range(dp) for m in members])
        return hit

    def reshard(self, src: Layout, dst: Layout, itemsize: int, to_global: Callable[[int], int]) -> tuple[float, float]:
        """(forward, backward) seconds to turn `src` into `dst`; device ids go through `to_global`."""
        if src == dst:
            return 0.0, 0.0
        direct = (src, dst, itemsize)
        hit = self._reshard_direct.get(direct)
        if hit is not None:
            return hit
        out = self._reshard_relabelled(src, dst, itemsize, to_global)
        self._reshard_direct[direct] = out
        return out

    def _reshard_relabelled(self, src: Layout, dst: Layout, itemsize: int, to_global) -> tuple[float, float]:
        ids = sorted(set(src.group) | set(dst.group))
        nodes = tuple(to_global(d) // self.cluster.devices_per_node for d in ids)
        node_key = tuple(n - nodes[0] for n in nodes)
        rel = {d: i for i, d in enumerate(ids)}
        s = Layout(src.shape, tuple(rel[d] for d in src.group), src.replicas, src.partial, src.splits, src.blocks)
        t = Layout(dst.shape, tuple(rel[d] for d in dst.group), dst.replicas, dst.partial, dst.splits, dst.blocks)
        key = (s, t, itemsize, node_key)
        hit = self._reshard.get(key)
        if hit is not None:
            return hit
        local = len(set(nodes)) <= 1
        fn = _StepCost(self.net.alpha_in if local else self.net.alpha_x,
                       self.net.beta_in if local else self.net.beta_x, itemsize)
        plan = plan_reshard(s, t, fn)
        fwd = bwd = 0.0
        for step in plan.steps:
            members = step.groups[0] if step.groups else ()
            sp = Span(step.group_size, len({nodes[m] for m in members}) if members else 1,
                      max(sum(1 for m in members if nodes[m] == nd) for nd in {nodes[m] for m in members})
                      if members else 1)
            if step.kind in ("permute", "send"):
                sp = Span(2, 1 if local else 2, 1)
            nbytes = _full_bytes(step, itemsize)
            fwd += self.net.collective(step.kind, nbytes, sp)
            dual = DUAL.get(step.kind)
            if dual is not None:
                if step.kind == "chunk":
                    # the gradient of a local chunk is gathered back: the whole tensor over the group
                    k = max(len(members), 1)
                    whole = math.prod(step.src.local_shape()) * itemsize
                    bwd += self.net.collective("all-gather", whole, sp if k > 1 else Span(1, 1, 1))
                elif step.kind == "reduce-scatter":
                    bwd += self.net.collective("all-gather", nbytes, sp)
                else:
                    bwd += self.net.collective(dual, nbytes, sp)
        out = self._reshard[key] = (fwd, bwd)
        return out

    def all_reduce(self, nbytes: float, devices: Sequence[int]) -> float:
        """All-reduce of `nbytes` over global `devices`."""
        return self.net.all_reduce(nbytes, self._span(devices))

    def reduce_scatter(self, nbytes: float, devices: Sequence[int]) -> float:
        """Reduce-scatter of a whole tensor of `nbytes` over global `devices`."""
        return self.net.reduce_scatter(nbytes, self._span(devices))

    def all_reduce_span(self, nbytes: float, span: Span) -> float:
        return self.net.all_reduce(nbytes, span)

    # -- memory ----------------------------------------------------------------------------------------
    def _loss_bytes(self, training: Training) -> int:
        """Bytes per element a loss keeps and works in: eager, its fp32 upcast and log-probabilities;
        compiled (a compiled program that covers the loss, `Efficiency.compiled_loss`), one fused kernel
        that reads the logits in the training dtype, keeps them and writes their gradient in it."""
        if training.compiled and compiles_faster(self.cluster) and self.cluster.efficiency.compiled_loss:
            return training.act_bytes
        return max(4, training.act_bytes)

    def backward_working_set(self, name: str, p: Placement, training: Training) -> float:
        """Bytes an op's backward holds beside the activations: the gradient arriving for its outputs and
        the gradients it makes for its inputs that need one (in its compute dtype; a loss's in fp32)."""
        c = self.costs.ops[name]
        if not c.needs_grad or c.kind == "view":
            return 0.0
        counted = self._grad_inputs.get(name)
        if counted is None:  # which inputs get a gradient: a property of the op's place in the graph
            g = self.graph
            counted = self._grad_inputs[name] = tuple(
                g.values[u.value].kind not in ("param", "buffer", "constant") and g.meta(u.value).requires_grad
                for u in c.inputs)
        # identical layers' ops share the sum (the search asks for it once per op and placement)
        key = ("working set", c.key, counted, p.splits, p.blocks, training.act_bytes, self._loss_bytes(training))
        hit = self._time.get(key)
        if hit is not None:
            return hit
        self._time[key] = total = self._working_set(c, counted, p, training)
        return total

    def _working_set(self, c: OpCost, counted_inputs: tuple, p: Placement, training: Training) -> float:
        isz = self._loss_bytes(training) if c.fp32 else training.act_bytes
        fused_loss = c.fp32 and isz == training.act_bytes
        counts = p.label_counts()
        total = 0.0
        uses = [(u, True) for u in c.outputs] + list(zip(c.inputs, counted_inputs))
        for u, counted in uses:
            if not counted or u.itemsize is not None:
                continue
            div = 1
            for label in u.labels or ():
                div *= counts.get(label, 1)
            total += u.numel * isz / div
        if c.fp32 and not fused_loss:  # a loss's backward forms the softmax of its input beside the gradient
            logits = max((u for u in c.inputs if u.itemsize is None), key=lambda u: u.numel, default=None)
            if logits is not None:
                local = logits.numel * isz / math.prod(counts.get(x, 1) for x in (logits.labels or ()))
                total += local
                # DTensor's loss_parallel over split classes: a zeroed one-hot, the exponential and their sum
                if self.cluster.efficiency.loss_parallel_written_out and logits.labels \
                        and counts.get(logits.labels[-1], 1) > 1:
                    total += local
        return total

    def saved(self, name: str, p: Placement, training: Training,
              kept: Optional[Mapping[int, float]] = None) -> list[tuple[str, float, int]]:
        """(storage value, local bytes, replicas of it on the op's devices) the backward keeps; `kept`:
        per input, the fraction of it kept (an all-gathered input of column-split pieces keeps the
        piece it was gathered from, as the runtime does: `gathered_from_pieces`)."""
        c = self.costs.ops[name]
        if not c.saved and not c.saved_masks:
            return []
        ins, outs, _ = self.layouts(name, p)
        counts = p.label_counts()
        out = []
        # a stack that fuses element-wise chains by hand recomputes their intermediates in backward
        fused = c.saved_fused is not None and self.cluster.efficiency.fused_elementwise
        for i in (c.saved_fused if fused else c.saved):
            u = c.inputs[i] if i >= 0 else c.outputs[~i]
            lay = ins[i] if i >= 0 else outs[~i]
            div = 1
            for l in u.labels or ():
                div *= counts.get(l, 1)
            base = self.costs.storage(u.value)
            base_meta = self.graph.values[base].meta
            numel = base_meta.numel if base_meta is not None else u.numel
            # an eager loss keeps its fp32 log-probabilities (the upcast logits' softmax), whatever the
            # precision; a compiled one its logits (`_loss_bytes`)
            size = numel * (u.itemsize or (self._loss_bytes(training) if c.fp32 else training.act_bytes)) / div
            if i == 0 and name in training.fp8_ops and self.cluster.efficiency.fp8_saves_float8 \
                    and "fp8" in self.cluster.peak_flops:
                size *= DTYPE_BYTES["fp8"] / training.act_bytes  # kept as the product's float8 operand
            if kept and i in kept:
                size *= kept[i]
            out.append((base, size, lay.replicas if lay is not None else 1))
        if c.saved_masks:
            div = 1
            for l in (c.outputs[0].labels if c.outputs else ()) or ():
                div *= counts.get(l, 1)
            out.append((f"{name}:mask", c.saved_masks / div, outs[0].replicas if outs and outs[0] is not None else 1))
        return out


def gathered_from_pieces(src: Layout, dst: Layout) -> bool:
    """Whether `dst` is reached from `src` by gathering pieces (all-gathers, no partial sums): the
    runtime then keeps, for a consumer whose gradient is partial (column-split pieces), only the piece
    (`kernels.collectives.pack_saved`), as Megatron's sequence parallelism does."""
    return (src != dst and src.partial == 1 and set(src.group) == set(dst.group)
            and math.prod(src.local_shape()) < math.prod(dst.local_shape()))
