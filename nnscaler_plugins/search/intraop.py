"""Intra-op search: which label of each op to split, and how far, on a stage's device group.

The group is seen as a mesh of one or two axes; an op's `Choice` names, per axis, the label it is
split along (or None: copied along that axis). The search does not enumerate every op's choice (that
space is exponential in the ops). It enumerates the choices of the *anchors* -- the matmuls with a
weight parameter, the embedding lookups and the losses, where column, row, vocabulary and data
parallelism are decided -- and lets every other op take, in graph order, the choice that is
cheapest given where its inputs already are (compute plus the resharding of its inputs, forward and
backward): that greedy walk is what turns a column-split matmul into a split GeLU and a row-split
partner, or a partial sum into a reduce-scatter onto the sequence. Anchors are improved one at a
time (coordinate descent, each move re-walked and evaluated exactly) from several seeds: the greedy
walk itself, every op along the batch (data parallelism inside the group), and a Transformers
tensor-parallel plan when one is given.

Identical layers are solved once: a template layer's choices are shared by all repeats, and the
cost is taken on a window of the ops before the layers, two layers and the ops after them (the
second layer sees the steady state: its inputs come from a layer like itself), weighting the second
layer by the number of repeats.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

from nnscaler_plugins.capture.graph import Graph, OpNode, TensorMeta
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.layout import Layout
from nnscaler_plugins.plan.layers import layer_groups
from nnscaler_plugins.plan.mesh import subop_devices
from nnscaler_plugins.rules import op_call
from nnscaler_plugins.rules.anchors import matmul_anchor, vocab_anchor
from nnscaler_plugins.rules.signature import LocalCall
from nnscaler_plugins.search import group_kernels
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.dims import BATCH, SEQUENCE, tag_labels
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.pass_seeds import PassSeeds
from nnscaler_plugins.search.replication import PARALLEL, batch_degree, duplicated_share
from nnscaler_plugins.search.segments import Segment, Walker, itemsize

_PLACEMENTS: dict = {}  # (Choice, devices) -> Placement; a pure function's cache


@dataclass(frozen=True)
class Choice:
    axes: tuple  # ((label or None, size), ...), outer to inner
    blocks: tuple = ()  # ((label, block factor),)

    @property
    def splits(self) -> bool:
        return any(l is not None for l, _ in self.axes)

    def describe(self) -> str:
        text = " x ".join(f"{l}/{n}" if l is not None else f"copy{n}" for l, n in self.axes)
        if self.blocks:
            text += " " + ",".join(f"{l} in {b} blocks" for l, b in self.blocks)
        return text

    def placement(self, devices: Sequence[int]) -> Placement:
        key = (self, tuple(devices))
        p = _PLACEMENTS.get(key)
        if p is None:
            if len(_PLACEMENTS) > 200000:
                _PLACEMENTS.clear()
            p = _PLACEMENTS[key] = self._placement(tuple(devices))
        return p

    def _placement(self, devices: Sequence[int]) -> Placement:
        """The OpPlacement-style split: splits in axis order, copies outermost, and sub-op -> device
        so that every op's pieces sit at the same mesh coordinates."""
        mesh = [n for _, n in self.axes]
        split_axes = [i for i, (l, _) in enumerate(self.axes) if l is not None]
        copy_axes = [i for i, (l, _) in enumerate(self.axes) if l is None]
        splits = tuple((self.axes[i][0], self.axes[i][1]) for i in split_axes)
        replicate = math.prod(mesh[i] for i in copy_axes)
        out = [devices[d] for d in subop_devices(mesh, split_axes)]
        return Placement(splits, replicate, tuple(sorted(self.blocks)), tuple(out))


@dataclass
class IntraResult:
    """One solved assignment for a mesh: per op its choice, and the segment sums of the window."""

    mesh: tuple
    choices: dict  # op name -> Choice (every op of the graph)
    time: float  # objective: per micro-batch time of the whole model on one group (+ amortised sync)
    memory: float  # activations per micro-batch plus model states, bytes per device
    seed: str = ""
    layer_segments: list = field(default_factory=list)  # per layer: Segment (identical layers share one)
    pre: Optional[Segment] = None
    post: Optional[Segment] = None
    tp: int = 1
    sequence_parallel: bool = False  # Megatron's sequence parallelism: the layers' sequence splits are in `choices`
    cp: int = 1  # context parallelism: attention split along its sequence this many ways (0 ops: 1)
    cp_comm: str = "ring"  # how those pieces meet their keys (the plan's `cp_comm`)
    ep: int = 1  # expert parallelism: the largest expert split of a mixture-of-experts layer
    batch: int = 1  # the largest split of an op along its batch (data parallelism inside the group)
    duplicated: float = 0.0  # share of the work the group's copies compute again (`replication`)

    def key(self) -> tuple:
        return tuple(sorted((k, v) for k, v in self.choices.items()))


class IntraSolver:
    """Solve the intra-op choices of one graph on one mesh of devices."""

    def __init__(self, graph: Graph, cm: CostModel, training: Training, mesh: tuple, constraints: Sequence = (),
                 hf_plan=None, micro_batches_hint: int = 1, dp_hint: int = 1, allow_blocks: bool = True,
                 context_parallel: bool = False):
        self.graph, self.cm, self.t = graph, cm, training
        # Attention split along its sequence is context parallelism, priced by `group_kernels` for a
        # `cp_comm`; outside a context-parallel search that split is not offered at all.
        self.context_parallel = context_parallel
        self.cp_comm = "ring"
        self.mesh = tuple(mesh)
        self.group = math.prod(self.mesh)
        self.devices = tuple(range(self.group))
        self.constraints = list(constraints)
        self.hf_plan = hf_plan
        self.m_hint = max(1, micro_batches_hint)
        self.dp_hint = max(1, dp_hint)
        costs = cm.costs
        self.sigs = costs.signatures
        self.tags = tag_labels(graph, self.sigs)
        self.groups = layer_groups(graph)
        self._setup_window()
        self.block_factors = sorted({b for s in self.sigs.values() for b in (getattr(s, "blocks", None) or {}).values()
                                     if b > 1}) if allow_blocks else []
        self._choices: dict[str, list[Choice]] = {}
        self._calls: dict = {}
        self._local: dict = {}
        self._static: dict = {}
        self._folds: dict = {}
        self._decisions: dict = {}
        self._evaluated: dict = {}
        self.anchors = self._find_anchors()
        self.pass_seeds = PassSeeds(graph, self.window)  # tensor, sequence and context parallelism of the passes
        # causal attention under context parallelism is balanced: the mirrored 2-block sequence split
        self.cp_block = -2 if context_parallel and any(
            group_kernels.kind_of(graph, op) == "attention" and (self.cm.costs.ops[op.name].attn or (0,) * 5)[4]
            for op in graph.ops) else 1

    def set_cp_comm(self, mode: str) -> None:
        """Price attention split along its sequence for `mode` from now on (the caches that depend on it go)."""
        if mode != self.cp_comm:
            self.cp_comm = mode
            self._local.clear()
            self._decisions.clear()
            self._evaluated.clear()

    # -- the window ---------------------------------------------------------------------------------------
    def _setup_window(self) -> None:
        g = self.groups
        ops = self.graph.ops
        self.var: dict[str, str] = {op.name: op.name for op in ops}  # op -> variable (template position)
        layers = g.layers
        keys = [tuple(self.cm.costs.ops[op.name].key for op in layer) for layer in layers]
        self.identical = len(layers) >= 2 and all(k == keys[1] for k in keys[1:]) and len(keys[0]) == len(keys[1]) \
            and all(self.cm.costs.ops[a.name].key[0] == self.cm.costs.ops[b.name].key[0]
                    for a, b in zip(layers[0], layers[1]))
        if self.identical:
            template = layers[1]
            for layer in layers:
                for pos, op in enumerate(layer):
                    self.var[op.name] = template[pos].name
            self.window = list(g.pre) + list(layers[0]) + list(layers[1]) + list(g.post)
            self.segment = {}
            for op in g.pre:
                self.segment[op.name] = 0
            for op in layers[0]:
                self.segment[op.name] = 1
            for op in layers[1]:
                self.segment[op.name] = 2
            for op in g.post:
                self.segment[op.name] = 3
            self.weights = [1, 1, len(layers) - 1, 1]
            self.layer_seg = {1, 2}
        else:
            self.window = list(ops)
            index = {}
            for i, layer in enumerate(layers):
                for op in layer:
                    index[op.name] = i + 1
            self.segment = {op.name: index.get(op.name, 0 if not layers or op in g.pre else len(layers) + 1)
                            for op in ops}
            for op in g.post:
                self.segment[op.name] = len(layers) + 1
            self.weights = [1] * (len(layers) + 2)
            self.layer_seg = set(range(1, len(layers) + 1)) if layers else {0}
        self.position = {op.name: i for i, op in enumerate(self.window)}
        consumers: dict[str, list[OpNode]] = {}
        for op in self.window:
            for v in op.inputs:
                consumers.setdefault(v, []).append(op)
        self.consumers = consumers

    # -- choices ---------------------------------------------------------------------------------------------
    def call(self, op: OpNode):
        c = self._calls.get(op.name)
        if c is None:
            c = self._calls[op.name] = op_call(self.graph, op)
        return c

    def batch_label(self, op: OpNode) -> Optional[str]:
        return next((l for l, t in self.tags.get(op.name, {}).items() if t == BATCH), None)

    def seq_label(self, op: OpNode) -> Optional[str]:
        return next((l for l, t in self.tags.get(op.name, {}).items() if t == SEQUENCE), None)

    def choices(self, op: OpNode) -> list[Choice]:
        """Every valid choice of an op on the mesh, allowed by the constraints."""
        found = self._choices.get(op.name)
        if found is not None:
            return found
        sig = self.sigs[op.name]
        call = self.call(op)
        labels = [None] + ([l for l in sig.splittable()] if any(o is not None for o in op.outputs) else [])
        blabel = self.batch_label(op)
        # outer axes of a 2-D mesh carry data parallelism (the batch) or nothing; the inner axis anything
        outer = [None] + ([blabel] if blabel in labels else [])
        slabel = self.seq_label(op) if self.context_parallel else None
        if slabel is not None and slabel in labels and slabel != blabel:
            outer.append(slabel)  # context parallelism outside tensor parallelism (Megatron's cp x tp)
        per_axis = [outer for _ in self.mesh[:-1]] + [labels]
        per_axis = [opts if n > 1 else [None] for opts, n in zip(per_axis, self.mesh)]  # a 1-wide axis splits nothing
        out: list[Choice] = []
        forbidden = set()
        for c in self.constraints:
            label_for = getattr(c, "label_for", None)
            if label_for is not None:
                lab = label_for(op, sig, self.tags)
                if lab is not None:
                    forbidden.add(lab)
        for combo in itertools.product(*per_axis):
            counts: dict[str, int] = {}
            for l, n in zip(combo, self.mesh):
                if l is not None:
                    counts[l] = counts.get(l, 1) * n
            if any(l in forbidden for l in counts):
                continue
            if not self.context_parallel and group_kernels.is_cp_split(self.graph, op, counts):
                continue
            if not all(sig.divides(l, n, call) for l, n in counts.items()):
                continue
            axes = tuple(zip(combo, self.mesh))
            ch = Choice(axes)
            allowed = all(con.allows_op(op, axes, blabel) for con in self.constraints)
            if allowed and self.refusal(op, ch) is None:
                out.append(ch)
            seq = self.seq_label(op) if self.cp_block != 1 else None
            if seq is not None and seq in counts and sig.blockable(seq, call) is None \
                    and sig.divides(seq, counts[seq], call, self.cp_block):
                mirrored = Choice(axes, ((seq, self.cp_block),))
                if allowed and self.refusal(op, mirrored) is None:
                    out.append(mirrored)
            for b in self.block_factors:
                for l in counts:
                    if sig.blockable(l, call) is None and sig.divides(l, counts[l], call, b):
                        blocked = Choice(axes, ((l, b),))
                        if allowed and self.refusal(op, blocked) is None:
                            out.append(blocked)
        if not out:
            out = [Choice(tuple((None, n) for n in self.mesh))]
        self._choices[op.name] = out
        return out

    def refusal(self, op: OpNode, ch: Choice) -> Optional[str]:
        """Why the op cannot run this choice (None when it can), as code generation would find out.

        The op's rule decides: lowering hands each piece to the rule's `localize`, which returns what
        the piece runs or raises PlanError for a split the runtime has no kernel for (cross-entropy
        split along both its class and its batch dims). The same call on the same piece shapes here
        keeps such choices out of the search, so every plan it returns can be executed."""
        sig = self.sigs[op.name]
        if not ch.splits:
            return None
        p = ch.placement(self.devices)
        ins, outs, _ = self.cm.layouts(op.name, p)
        # a tensor the split gives no layout (one merged dim cut along two labels, a mirrored split of
        # a merged dim): lowering refuses the plan, and the cost model could not price it
        values = self.graph.values
        if any(lay is None and values[v].meta is not None for v, lay in zip(op.inputs, ins)) or \
                any(lay is None and v is not None and values[v].meta is not None for v, lay in zip(op.outputs, outs)):
            return f"its split {ch.describe()} has no layout for some tensor"
        if sig.localize is None:
            return None
        call = self.call(op)
        local_in = tuple(_local_meta(m, l) for m, l in zip(call.inputs, ins))
        local_out = tuple(_local_meta(m, l) for m, l in zip(call.outputs, outs))
        counts = p.label_counts()
        for index in _piece_indices(p.splits):
            try:
                sig.localize(LocalCall(call=call, splits=counts, index=index, local_inputs=local_in,
                                       local_outputs=local_out))
            except PlanError as e:
                return str(e)
        return None

    def _is_anchor_n(self, op: OpNode, label: str) -> bool:
        a = matmul_anchor(self.graph, op, self.sigs[op.name])
        return a is not None and a.n == label

    def _find_anchors(self) -> list[str]:
        """Variables (template positions or ops) where the big decisions are made."""
        out = []
        seen = set()
        for op in self.window:
            var = self.var[op.name]
            if var in seen:
                continue
            sig = self.sigs[op.name]
            if matmul_anchor(self.graph, op, sig) is not None or vocab_anchor(self.graph, op, sig) is not None \
                    or sig.comm_labels:
                out.append(var)
                seen.add(var)
        return out

    # -- the greedy walk ---------------------------------------------------------------------------------------
    def _srcs(self, op: OpNode, produced: dict, storage: dict) -> tuple:
        """Where the op's inputs are, as ids of interned layout objects (cheap to hash)."""
        static = self._static.get(op.name)
        if static is None:
            static = self._static[op.name] = tuple(self.graph.values[v].kind in ("param", "buffer", "constant")
                                                    for v in op.inputs)
        return tuple(id(storage.get(v)) if st else id(produced.get(v)) for v, st in zip(op.inputs, static))

    def _fold(self, need: Layout) -> Layout:
        """The layout a parameter is kept in when its first reader needs `need` (interned)."""
        kept = self._folds.get(id(need))
        if kept is None:
            kept = self._folds[id(need)] = (need, Layout(need.shape, need.group, need.replicas * need.partial, 1,
                                                         need.splits, need.blocks))
        return kept[1]

    def _local_cost(self, op: OpNode, ch: Choice, produced: dict, storage: dict, srcs: tuple = None) -> float:
        srcs = srcs if srcs is not None else self._srcs(op, produced, storage)
        key = (op.name, ch, srcs)
        hit = self._local.get(key)
        if hit is not None:
            return hit
        cost = self._local_cost_uncached(op, ch, produced, storage)
        self._local[key] = cost
        return cost

    def _local_cost_uncached(self, op: OpNode, ch: Choice, produced: dict, storage: dict) -> float:
        p = ch.placement(self.devices)
        cm, t = self.cm, self.t
        # priced as the Walker prices it: with sequence parallelism a layer's op that runs whole on
        # every device of the group does 1/group of the work
        sp = (t.sequence_parallel and self.segment.get(op.name) in self.layer_seg and not p.splits
              and p.replicate > 1 and cm.costs.ops[op.name].kind == "memory")
        ot = cm.op_time(op.name, p, t, p.replicate if sp else 1)
        special = group_kernels.price(cm, op, p, t, self.cp_comm)
        if special is not None:
            ot = special.time
        cost = ot.fwd + ot.bwd_input + ot.bwd_weight
        if special is not None:
            cost += special.fwd_comm + special.bwd_comm
        ins, outs, grads = cm.layouts(op.name, p)
        g = self.graph
        for i, v in enumerate(op.inputs):
            need = ins[i]
            val = g.values[v]
            if need is None or val.meta is None:
                continue
            isz = itemsize(val.meta.dtype, t)
            if val.kind in ("param", "buffer", "constant"):
                src = storage.get(v)
                if src is None:
                    # the parameter is kept where its first consumer needs it: its gradient is
                    # summed over the pieces that read it whole, once per step
                    if val.kind == "param" and grads[i] > 1 and val.meta.requires_grad:
                        local = math.prod(need.local_shape()) * t.grad_bytes
                        cost += cm.all_reduce(local, list(range(grads[i]))) / self.m_hint
                    continue
                if src != need and set(src.group) == set(need.group):
                    f, b = cm.reshard(src, need, isz, lambda d: d)
                    cost += f + b
                continue
            src = produced.get(v)
            if src is None:
                src = Layout.replicated(need.shape, need.group)
            if src != need:
                f, b = cm.reshard(src, need, isz, lambda d: d)
                cost += f + (b if val.meta.requires_grad else 0.0)
            if grads[i] > 1 and val.meta.requires_grad and op.grad_enabled:
                local = math.prod(need.local_shape()) * isz
                cost += cm.all_reduce(local, list(range(grads[i])))
        # An op that starts a split (its activations all arrive whole) is charged what a consumer
        # would pay to have the output whole again: a split is only worth starting when it saves
        # more than that. Without it the walk splits cheap ops (positions, masks) whose consumers
        # then gather them; ops whose inputs already arrive split follow them at no charge.
        starts = all(produced.get(v) is None or produced[v].replicas == produced[v].num_devices
                     for v in op.inputs if g.values[v].kind not in ("param", "buffer", "constant"))
        for j, v in enumerate(op.outputs if starts else ()):
            lay = outs[j] if j < len(outs) else None
            if v is None or lay is None or lay.replicas == lay.num_devices or g.values[v].meta is None:
                continue
            whole = Layout.replicated(lay.shape, lay.group)
            cost += cm.reshard(lay, whole, itemsize(g.values[v].meta.dtype, t), lambda d: d)[0]
        return cost

    def walk(self, fixed: dict[str, Choice], default: Optional[Callable[[OpNode, dict], Optional[Choice]]] = None,
             template_passes: int = 2) -> Optional[dict[str, Choice]]:
        """Choices for every variable: `fixed` ones as given, the others greedily in graph order.

        Template variables are decided while walking the second layer (the steady state), after a
        first pass has fixed what the first layer hands on. A parameter read by several ops (tied
        embeddings) is split the same way for all of them, as pipeline stages that share it must;
        None when a fixed choice breaks that."""
        decided: dict[str, Choice] = {}
        for _ in range(template_passes if self.identical else 1):
            produced: dict[str, Layout] = {}
            storage: dict[str, Layout] = {}
            first_pass = not decided
            for op in self.window:
                var = self.var[op.name]
                seg = self.segment[op.name]
                redo = var not in fixed and (first_pass or seg == 2 or var == op.name)
                if var in fixed:
                    ch = fixed[var]
                    if not self._tied_ok(op, ch, storage):
                        return None
                elif not redo and var in decided:
                    ch = decided[var]
                else:
                    pick = default(op, produced) if default is not None else None
                    if pick is not None:
                        ch = pick
                    else:
                        srcs = self._srcs(op, produced, storage)
                        ch = self._decisions.get((op.name, srcs))
                        if ch is None:
                            best = None
                            cands = [c for c in self.choices(op) if self._tied_ok(op, c, storage)] or self.choices(op)
                            for cand in cands:
                                c = self._local_cost(op, cand, produced, storage, srcs)
                                key = (round(c, 12), cand.splits, len(cand.blocks))
                                if best is None or key < best[0]:
                                    best = (key, cand)
                            ch = self._decisions[(op.name, srcs)] = best[1]
                    if seg != 1 or var == op.name or first_pass:
                        decided[var] = ch
                p = ch.placement(self.devices)
                ins, outs, _ = self.cm.layouts(op.name, p)
                for i, v in enumerate(op.inputs):
                    if v not in storage and ins[i] is not None and self.graph.values[v].kind in ("param", "buffer",
                                                                                                "constant"):
                        storage[v] = self._fold(ins[i])
                for j, v in enumerate(op.outputs):
                    if v is not None and j < len(outs) and outs[j] is not None:
                        produced[v] = outs[j]
        for var, ch in fixed.items():
            decided[var] = ch
        return decided

    def _tied_ok(self, op: OpNode, ch: Choice, storage: dict) -> bool:
        tied = [i for i, v in enumerate(op.inputs) if v in storage]
        if not tied:
            return True
        ins, _, _ = self.cm.layouts(op.name, ch.placement(self.devices))
        for i in tied:
            need = ins[i]
            if need is None:
                continue
            if self._fold(need) != storage[op.inputs[i]]:
                return False
        return True

    # -- exact evaluation ----------------------------------------------------------------------------------------
    def evaluate(self, assign: dict[str, Choice], seed: str = "") -> IntraResult:
        key = frozenset(assign.items())
        hit = self._evaluated.get(key)
        if hit is not None:
            return hit if hit.seed == seed else replace(hit, seed=seed)
        result = self._evaluate(assign, seed)
        self._evaluated[key] = result
        return result

    def _evaluate(self, assign: dict[str, Choice], seed: str = "") -> IntraResult:
        nseg = len(self.weights)
        sp_ops = {n for n, k in self.segment.items() if k in self.layer_seg} if self.t.sequence_parallel else None
        walker = Walker(self.graph, self.cm, self.t, nseg, layer_segments=self.layer_seg, sp_layers=sp_ops,
                        group_of=lambda n: self.segment[n] if self.segment[n] in self.layer_seg else None,
                        cp_comm=self.cp_comm)
        placements = {op.name: assign[self.var[op.name]].placement(self.devices) for op in self.window}
        segs = walker.run(self.window, placements.__getitem__, self.segment.__getitem__, lambda a, b: False)
        time = memory = 0.0
        t = self.t
        state_bytes = t.param_bytes + t.grad_bytes + t.master_bytes + t.optimizer_bytes
        for w, s in zip(self.weights, segs):
            time += w * (s.fwd + s.bwd_input + s.bwd_weight + s.fwd_comm + s.bwd_comm)
            memory += w * s.activations
            for v, (el, devs, part) in s.params.items():
                memory += w * el * state_bytes
                shard = part * self.dp_hint
                if shard > 1:
                    time += w * self.cm.all_reduce(el * t.grad_bytes, list(range(part))) / self.m_hint
        choices = {op.name: assign[self.var[op.name]] for op in self.graph.ops if self.var[op.name] in assign}
        result = IntraResult(self.mesh, choices, time, memory, seed, sequence_parallel=self.t.sequence_parallel,
                             cp_comm=self.cp_comm)
        for var, ch in assign.items():
            op = self.graph.op(var)
            kind = group_kernels.kind_of(self.graph, op)
            counts = dict(ch.placement(self.devices).label_counts()) if kind else {}
            if kind == "attention":
                result.cp = max(result.cp, counts.get(group_kernels.SEQUENCE, 1))
            elif kind == "experts":
                result.ep = max(result.ep, counts.get(group_kernels.EXPERTS, 1))
        if self.identical:
            n = len(self.groups.layers)
            result.pre, result.post = segs[0], segs[3]
            result.layer_segments = [segs[1]] + [segs[2]] * (n - 1)
        else:
            result.pre, result.post = segs[0], segs[-1]
            result.layer_segments = list(segs[1:-1]) if self.groups.layers else [segs[0]]
            if not self.groups.layers:
                result.pre, result.post = Segment(), Segment()
        result.tp = max((math.prod(n for l, n in ch.axes if l is not None and l != self.batch_label(self.graph.op(var))
                                   and not (self.context_parallel and l == self.seq_label(self.graph.op(var))))
                         for var, ch in assign.items()), default=1)
        costs = self.cm.costs.ops
        result.batch = batch_degree(choices, lambda name: self.batch_label(self.graph.op(name)))
        result.duplicated = duplicated_share(((costs[name], math.prod(n for l, n in ch.axes if l is None))
                                              for name, ch in choices.items()), self.group)
        return result

    # -- the search ---------------------------------------------------------------------------------------------
    def _anchor_moves(self, op: OpNode) -> list[Choice]:
        """The choices worth trying at an anchor: copy, batch, or its matmul / vocabulary labels."""
        sig = self.sigs[op.name]
        keep = {None, self.batch_label(op)}
        a = matmul_anchor(self.graph, op, sig)
        if a is not None:
            keep |= {a.k, a.n}
        v = vocab_anchor(self.graph, op, sig)
        if v is not None:
            keep.add(v.label)
        keep |= set(sig.comm_labels)
        return [c for c in self.choices(op) if c.axes[-1][0] in keep]

    def whole_between(self, op: OpNode, produced: dict) -> Optional[Choice]:
        """Megatron's rule for the ops between the matmuls: follow an input that arrives split (None:
        let the walk choose), otherwise run whole on every device of the group (data parallelism on
        the outer axis of a 2-D mesh stays)."""
        for v in op.inputs:
            lay = produced.get(v)
            if lay is not None and self.graph.values[v].kind not in ("param", "buffer", "constant") \
                    and lay.replicas * lay.partial < lay.num_devices:
                return None
        want = tuple((self.batch_label(op), n) for n in self.mesh[:-1]) + ((None, self.mesh[-1]),)
        return next((c for c in self.choices(op) if c.axes == want and not c.blocks), None)

    def improve(self, fixed: dict[str, Choice], seed: str, passes: int = 2,
                on_step: Optional[Callable[[], None]] = None, default=None) -> IntraResult:
        """Coordinate descent over the anchors' choices, each move re-walked and evaluated exactly."""
        assign = self.walk(fixed, default) or self.walk({}, default)
        fixed = {a: assign[a] for a in self.anchors if a in assign}
        best = self.evaluate(assign, seed)
        for _ in range(passes):
            changed = False
            for a in self.anchors:
                op = self.graph.op(a)
                for cand in self._anchor_moves(op):
                    if cand == fixed.get(a):
                        continue
                    trial = dict(fixed)
                    trial[a] = cand
                    walked = self.walk(trial, default)
                    if walked is None:
                        continue
                    res = self.evaluate(walked, seed)
                    if on_step is not None:
                        on_step()
                    if res.time < best.time * (1 - 1e-9):
                        best, fixed, changed = res, trial, True
            if not changed:
                break
        return best

    def _tensor_parallel_seed(self, outer_label: Optional[Callable[[OpNode], Optional[str]]] = None) -> dict:
        """Megatron's assignment as the `tp` strategy finds it (`passes.apply_tp`, run on the window
        for the group's inner axis): each anchor (matmuls with a weight, embeddings, losses) takes
        the pass's split on the inner axis, or stays whole where the pass keeps it whole. The outer
        axes of a 2-D mesh carry the batch, or what `outer_label` names (the sequence, for cp x tp)."""
        seed: dict[str, Choice] = {}
        outer_label = outer_label or self.batch_label
        outer = lambda op: tuple((outer_label(op), n) for n in self.mesh[:-1])  # noqa: E731
        inner = self.mesh[-1]
        splits = self.pass_seeds.tensor_parallel(inner)
        if not splits:
            return seed
        for op in self.window:
            var = self.var[op.name]
            if var in seed or var not in self.anchors:
                continue
            label, block = splits.get(op.name, (None, 1))
            want = (outer(op) + ((label, inner),), ((label, block),) if label is not None and block > 1 else ())
            mirrored = tuple((l, self.cp_block) for l, _ in want[0][:-1] if l is not None and l == self.seq_label(op)
                             and self.cp_block != 1)
            options = [c for c in self.choices(op) if c.axes == want[0]]
            ch = next((c for c in options if c.blocks == (want[1] or mirrored)), None) or \
                next((c for c in options if c.blocks == want[1]), None)
            if ch is not None:
                seed[var] = ch
        return seed

    def seeds(self) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = [("greedy", {})]
        if self.mesh[-1] > 1:
            tp = self._tensor_parallel_seed()
            if tp:
                out.append(("tensor-parallel", tp))
        dp = {}
        for op in self.window:
            var = self.var[op.name]
            if var in dp:
                continue
            bl = self.batch_label(op)
            want = tuple((bl, n) for n in self.mesh)
            ch = next((c for c in self.choices(op) if c.axes == want and not c.blocks), None)
            dp[var] = ch if ch is not None else next((c for c in self.choices(op) if not c.splits),
                                                     self.choices(op)[0])
        out.append(("data-parallel", dp))
        if self.hf_plan is not None and self.group > 1:
            prior = {}
            for op in self.window:
                var = self.var[op.name]
                style = self.hf_plan.style_of(op)
                if style is None or var in prior:
                    continue
                anchor = matmul_anchor(self.graph, op, self.sigs[op.name])
                if anchor is None:
                    continue
                label = {"column": anchor.n, "row": anchor.k, "replicate": None}[style]
                inner = self.mesh[-1]
                outer = tuple((self.batch_label(op), n) for n in self.mesh[:-1])
                want = outer + ((label, inner),)
                ch = next((c for c in self.choices(op) if c.axes == want), None)
                if ch is not None:
                    prior[var] = ch
            if prior:
                out.append(("transformers tp plan", prior))
        return out

    def sequence_between(self, op: OpNode, produced: dict) -> Optional[Choice]:
        """Megatron's sequence parallelism as `passes.apply_sp` finds it: of the ops of a layer that
        `whole_between` would run whole on every device of the group (a norm, a dropout, a residual
        add), those the pass splits along the sequence are split so (data parallelism on an outer axis
        stays); any other op of a layer is left to the walk. Lowering then turns the partial sums of
        a row-parallel matmul into a reduce-scatter onto the sequence and gathers the sequence back
        before the next column-parallel one."""
        whole = self.whole_between(op, produced)
        if whole is None or self.segment.get(op.name) not in self.layer_seg:
            return whole
        split = self.pass_seeds.sequence_parallel(self.mesh[-1]).get(op.name)
        if split is not None and self.cm.costs.ops[op.name].kind != "matmul":
            want = whole.axes[:-1] + ((split[0], self.mesh[-1]),)
            found = next((c for c in self.choices(op) if c.axes == want and not c.blocks), None)
            if found is not None:
                return found
        return None  # not on the residual stream the pass splits: the walk picks (it finds reduce-scatters too)

    def sequence_split(self, choices: dict) -> bool:
        """Whether an assignment splits some op of the layers along its sequence label."""
        for op in self.window:
            if self.segment.get(op.name) not in self.layer_seg:
                continue
            label = self.seq_label(op)
            ch = choices.get(op.name)
            if label is not None and ch is not None and any(l == label for l, _ in ch.axes):
                return True
        return False

    def with_sequence_parallel(self, result: IntraResult) -> Optional[IntraResult]:
        """The same anchors with Megatron's sequence parallelism: the ops of the layers that the
        tensor-parallel assignment runs whole on every device of the group are split along the
        sequence (`sequence_between`), re-tuned by coordinate descent and priced as placed (the
        reduce-scatters and all-gathers lowering will emit, 1/group of those ops' work and
        activations, and nothing for the ops that stay whole). None when no op of the layers is
        split along the sequence."""
        anchors = {a: result.choices[a] for a in self.anchors if a in result.choices}
        seed = result.seed + " + sequence parallel"
        found = []
        walked = self.walk(anchors, self.sequence_between)  # Megatron's: the same anchors
        if walked is not None:
            found.append(self.evaluate(walked, seed))
        found.append(self.improve(anchors, seed + " (re-tuned)", default=self.sequence_between))
        found = [r for r in found if self.sequence_split(r.choices)]
        if not found:
            return None
        return replace(min(found, key=lambda r: (r.time, r.memory)), sequence_parallel=True)

    def solve(self, on_step: Optional[Callable[[], None]] = None, passes: int = 2) -> list[IntraResult]:
        """Non-dominated (time, memory) assignments found from every seed.

        The seeds that place the anchors (tensor parallelism, a Transformers plan; the greedy walk when
        there is no such seed) are improved by coordinate descent; data parallelism and the plain
        walk are taken as they are, as the other ends of the range."""
        results: list[IntraResult] = []
        seeds = self.seeds()
        improved = {"tensor-parallel", "transformers tp plan"} if any(n == "tensor-parallel" for n, _ in seeds) \
            else {"greedy", "transformers tp plan"}
        for name, fixed in seeds:
            if self.group == 1:
                results.append(self.evaluate(self.walk(fixed) or self.walk({}), name))
                break
            if name in improved:
                res = self.improve(fixed, name, passes, on_step)
            else:
                walked = self.walk(fixed)
                if walked is None:
                    continue
                res = self.evaluate(walked, name)
            results.append(res)
        if self.context_parallel and self.group > 1:
            results += self.context_parallel_results()
        return pareto_results(results)

    def sequence_everywhere(self, op: OpNode, produced: dict) -> Optional[Choice]:
        """Context parallelism as `passes.apply_cp` finds it (its sequence walk from the data inputs
        and every self-attention): an op the pass splits takes that split on the inner axis of the
        mesh (the batch on an outer one), mirrored for causal attention; an op it leaves whole is left
        to the walk (positions, label shifts: the lowering cuts them to match)."""
        found = self.pass_seeds.context_parallel(self.mesh[-1], self.cp_block == -2)
        split = (found or {}).get(op.name)
        if split is None:
            return None
        label, block = split
        want = tuple((self.batch_label(op), n) for n in self.mesh[:-1]) + ((label, self.mesh[-1]),)
        blocks = ((label, block),) if block != 1 else ()
        options = [c for c in self.choices(op) if c.axes == want]
        return next((c for c in options if c.blocks == blocks), None) or \
            next((c for c in options if not c.blocks and group_kernels.kind_of(self.graph, op) != "attention"), None)

    def context_parallel_results(self) -> list[IntraResult]:
        """Context parallelism with each `cp_comm`: every op that carries the sequence split along it
        (`sequence_everywhere`), the anchors then improved by coordinate descent; kept when attention
        is in fact split along its sequence. Ulysses only where every attention's heads divide."""
        out = []
        if self.pass_seeds.context_parallel(self.mesh[-1], self.cp_block == -2) is None:
            return out  # the cp pass refuses this graph (attention dropout, a mask): nothing to price
        if len(self.mesh) > 1:
            return self._cp_times_tp_results()
        seq_walk = self.walk({}, self.sequence_everywhere)
        for mode in group_kernels.CP_MODES:
            self.set_cp_comm(mode)
            found = []
            if seq_walk is not None:
                found.append(self.evaluate(seq_walk, f"context-parallel {mode}"))
                anchors = {a: seq_walk[a] for a in self.anchors if a in seq_walk}
                found.append(self.improve(anchors, f"context-parallel {mode} (re-tuned)", passes=1,
                                          default=self.sequence_everywhere))
            for r in found:
                if r.cp > 1 and (mode != "ulysses" or self._ulysses_ok(r)):
                    out.append(r)
        self.set_cp_comm("ring")
        return out

    def _cp_times_tp_results(self) -> list[IntraResult]:
        """Megatron's cp x tp on a 2-D mesh: the sequence split on the outer axis (mirrored for causal
        attention), tensor parallelism on the inner one (`_tensor_parallel_seed`), the other ops
        walked; each cp_comm, the anchors then improved."""
        seed = self._tensor_parallel_seed(self.seq_label)
        out = []
        if not seed:
            return out
        for mode in group_kernels.CP_MODES:
            self.set_cp_comm(mode)
            found = []
            walked = self.walk(seed)
            if walked is not None:
                found.append(self.evaluate(walked, f"cp x tp {mode}"))
            found.append(self.improve(seed, f"cp x tp {mode} (re-tuned)", passes=1))
            out += [r for r in found if r.cp > 1 and (mode != "ulysses" or self._ulysses_ok(r))]
        self.set_cp_comm("ring")
        return out

    def _ulysses_ok(self, result: IntraResult) -> bool:
        for op in self.graph.ops:
            if group_kernels.kind_of(self.graph, op) != "attention":
                continue
            counts = result.choices[op.name].placement(self.devices).label_counts()
            if counts.get(group_kernels.SEQUENCE, 1) > 1 and not group_kernels.ulysses_fits(self.cm, op, counts):
                return False
        return True


def _local_meta(meta: Optional[TensorMeta], lay: Optional[Layout]) -> Optional[TensorMeta]:
    """A piece's view of a tensor (the shape lowering hands to `localize`)."""
    if meta is None or lay is None:
        return meta
    return TensorMeta(tuple(lay.local_shape()), meta.dtype, meta.requires_grad)


def _piece_indices(splits: Sequence[tuple[str, int]]) -> list[dict[str, int]]:
    """Per piece of nested splits, each label's piece index (nested splits of a label combine
    row-major, as `OpPlacement.label_index` numbers them)."""
    out = []
    for digits in itertools.product(*(range(n) for _, n in splits)):
        index: dict[str, int] = {}
        for (l, n), i in zip(splits, digits):
            index[l] = index.get(l, 0) * n + i
        out.append(index)
    return out


def pareto_results(results: Iterable[IntraResult]) -> list[IntraResult]:
    out: list[IntraResult] = []
    seen = set()
    for r in sorted(results, key=lambda r: (r.time, r.memory, r.seed)):
        k = (tuple(sorted((n, c.axes, c.blocks) for n, c in r.choices.items())), r.cp_comm if r.cp > 1 else "")
        if k in seen:
            continue
        seen.add(k)
        # a plan that divides the work is only given up for another that does (`replication`)
        if any(o.time <= r.time and o.memory <= r.memory and (o.duplicated <= PARALLEL or r.duplicated > PARALLEL)
               for o in out):
            continue
        out.append(r)
    return out
