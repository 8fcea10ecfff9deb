"""Layout propagation: Megatron-style tensor parallelism found from dimension rules alone.

Why a propagation and not a pattern match: a pattern ("q/k/v then o", "gate/up then down") only
knows the models it was written for. Here the unit of reasoning is a tensor's layout on the unit of
`n` devices -- replicated, split along one dim (possibly blocked), or a partial sum -- and an op's
dimension rule says which layouts it accepts and produces. Walking the graph in order while keeping
every value's layout, each op takes the split that leaves its inputs where their producers put
them; whatever it cannot accept is left to the lowering, which inserts the collective.

The only decisions that are not local are the matmuls with a weight parameter. A matmul whose
activation arrives split along its reduce dim runs row-parallel (its output is a partial sum). A
matmul whose activation is whole may run column-parallel, but that only pays if the split output
can travel on, without a gather, to a row-parallel partner, to a group-aware kernel (vocabulary-
parallel cross-entropy) or to the model's outputs. That is checked by simulating the same local
choices ahead of the real walk. When a path stops at an op that wants the split in blocks (the
`split` of a fused QKV projection into three sections), the simulation is retried with that block
factor; when it still stops, the matmul stays replicated rather than paying a gather per step.

Vocabulary embeddings (a parameter holding the only dim that the op reduces over) are split along
the vocabulary, which gives a partial-sum output. When several embeddings are summed (token +
position embeddings), each split one would cost its own all-reduce because a partial sum cannot yet
flow through the add, so only the largest table of such a group is split.
"""
from __future__ import annotations

import enum
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lower.placement import Digit, DigitKind, label_digit, merged_host
from nnscaler_plugins.passes.parallelization import Parallelization
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.primitives import OpHandle, PlanBuilder
from nnscaler_plugins.rules import Signature, op_call, signature_for
from nnscaler_plugins.rules.anchors import (
    MatmulAnchor,
    VocabAnchor,
    matmul_anchor,
    vocab_anchor,
    weight_source,
)

_STATIC = ("param", "buffer", "constant")


class TPKind(enum.Enum):
    REPLICATED = "R"  # whole on every device
    SPLIT = "S"  # split along a dim into one chunk per device
    PARTIAL = "P"  # every device holds a tensor of full shape and the true value is their sum


@dataclass(frozen=True)
class TPLayout:
    """Where a tensor's elements live on the unit, as the walk sees it (one split of `n` pieces at
    a time; the lowering's full RVD reading of a plan is `nnscaler_plugins.layout.Layout`).

    `dim` is the dim a SPLIT cuts; with `block` > 1, each of `block` equal sections is split
    separately.
    """

    kind: TPKind
    dim: int = -1
    block: int = 1

    def __repr__(self) -> str:
        if self.kind is TPKind.SPLIT:
            return f"S({self.dim}{f', block={self.block}' if self.block > 1 else ''})"
        return self.kind.value


REPLICATED = TPLayout(TPKind.REPLICATED)
PARTIAL = TPLayout(TPKind.PARTIAL)


def split(dim: int, block: int = 1) -> TPLayout:
    return TPLayout(TPKind.SPLIT, dim, block)


def _of_digit(digit: Digit, block: int) -> TPLayout:
    """What one split does to a tensor (`placement.label_digit`) as a layout on the unit."""
    if digit.kind is DigitKind.SPLIT:
        return split(digit.dim, block)
    return PARTIAL if digit.kind is DigitKind.PARTIAL else REPLICATED


@dataclass(frozen=True)
class Choice:
    """How one op runs on the unit: whole (label None) or split along `label` into n pieces."""

    label: Optional[str] = None
    block: int = 1

    def __repr__(self) -> str:
        if self.label is None:
            return "replicate"
        return f"split {self.label!r}" + (f" in {self.block} blocks" if self.block > 1 else "")


REPLICATE = Choice()

# Conversion costs, coarse on purpose: the walk only has to tell "free" from "local slicing" (no
# forward communication, a gather of the gradient in backward) from "a collective per step".
FREE, SLICE, COMM = 0, 1, 4

# How many ops after a matmul that stayed whole a split may still start (`_seed_candidates`):
# the views and slices that cut heads out of a fused projection, not the rest of the model.
SEED_HOPS = 6


def conversion_cost(current: Optional[TPLayout], required: TPLayout) -> int:
    """Cost of handing a value held as `current` to an op that needs `required`.

    `current` None means the layout is not fixed yet (an unplaced parameter, or a value the walk
    has not reached), which any requirement can adopt.
    """
    if current is None or current == required:
        return FREE
    if required.kind is TPKind.PARTIAL and current.kind is TPKind.REPLICATED:
        return FREE  # a whole tensor is a valid partial sum: piece 0 keeps it, the others add zeros
    if current.kind is TPKind.REPLICATED and required.kind is TPKind.SPLIT:
        return SLICE
    return COMM


def _is_static(graph: Graph, value: str) -> bool:
    return graph.values[value].kind in _STATIC


@dataclass(frozen=True)
class Lookahead:
    ok: bool
    stop: Optional[OpHandle] = None
    demand: Optional[Choice] = None
    ends: tuple = ()  # the ops where a split path ended in a partial sum (row-parallel matmuls)


def supports_blocked_splits(builder: PlanBuilder) -> bool:
    """Whether this core can record a blocked split of an op (needed to column-split a fused QKV)."""
    try:
        return "block" in inspect.signature(builder.op_trans).parameters
    except (TypeError, ValueError):
        return False


class TensorParallelPropagation:
    """One `Choice` per op for the builder's unit; `run` decides, `apply` records on the builder.

    Deciding and recording are separate so that tests and `explain`-style tools can read the
    layouts and matmul roles the walk arrived at without making a plan.
    """

    def __init__(self, builder: PlanBuilder, degree: Optional[int] = None,
                 devices_of: Optional[Callable[[OpHandle], list[int]]] = None,
                 ops: Optional[list[OpHandle]] = None):
        """`degree` pieces per split op (default: the unit size); `devices_of(op)` gives the
        `degree` devices an op's pieces run on (default: devices 0..degree-1), which is how a
        pipeline stage gets tensor parallelism on its own device group. `ops` restricts the walk
        to a segment (a pipeline stage): values entering it from outside arrive whole."""
        self.builder = builder
        self.graph = builder.graph
        self.n = builder.unit_size if degree is None else int(degree)
        self.devices_of = devices_of or (lambda op: list(range(self.n)))
        self.ops = list(builder.ops) if ops is None else list(ops)
        self.position = {op.name: i for i, op in enumerate(self.ops)}
        self.blocked = supports_blocked_splits(builder)
        self.layout: dict[str, TPLayout] = {i.name: REPLICATED for i in self.graph.inputs
                                          if self.graph.values[i.name].meta is not None}
        made_here = {o for op in self.ops for o in op.node.outputs if o is not None}
        for op in self.ops:
            for v in op.node.inputs:
                if v not in made_here and not _is_static(self.graph, v):
                    self.layout[v] = REPLICATED
        self.stored: dict[str, TPLayout] = {}
        self.choices: dict[str, Choice] = {}
        self.roles: dict[str, str] = {}  # matmul anchors: "column" | "row" | "replicated"
        self.seeds: dict[str, Choice] = {}  # ops that may start a split a whole matmul could not
        self.stopped: dict[str, OpHandle] = {}  # matmul -> where its column split's path stopped
        # values computed from the output of such a matmul by ops that ran whole: where a split
        # may still start (`_seed_candidates`)
        self.whole_after_matmul: dict[str, int] = {}  # value -> ops since the matmul
        self._matmul: dict[str, Optional[MatmulAnchor]] = {}
        self._vocab: dict[str, Optional[VocabAnchor]] = {}
        self._calls = {op.name: op_call(self.graph, op.node) for op in self.ops}
        self._required: dict[tuple[str, Choice], tuple[list[TPLayout], list[Optional[TPLayout]]]] = {}
        self._divides: dict[tuple[str, Choice], bool] = {}
        self._last_use: dict[str, int] = {}
        self._consumers: dict[str, list[OpHandle]] = {}
        for i, op in enumerate(self.ops):
            for v in dict.fromkeys(op.node.inputs):
                self._last_use[v] = i
                self._consumers.setdefault(v, []).append(op)
        self.vocab_split = self._vocab_tables_to_split()

    # -- reading the rules --------------------------------------------------------------------------
    def _is_static(self, value: str) -> bool:
        return _is_static(self.graph, value)

    def matmul_anchor(self, op: OpHandle) -> Optional[MatmulAnchor]:
        if op.name not in self._matmul:
            self._matmul[op.name] = matmul_anchor(self.graph, op.node, op.signature)
        return self._matmul[op.name]

    def vocab_anchor(self, op: OpHandle) -> Optional[VocabAnchor]:
        if op.name not in self._vocab:
            self._vocab[op.name] = vocab_anchor(self.graph, op.node, op.signature)
        return self._vocab[op.name]

    def _sig_block(self, sig: Signature, label: str, index: Optional[int] = None) -> int:
        blocks = getattr(sig, "blocks", None) or {}
        found = [b for (l, i), b in blocks.items() if l == label and (index is None or i == index)]
        return max(found, default=1)

    def divides(self, op: OpHandle, choice: Choice) -> bool:
        if choice.label is None:
            return True
        key = (op.name, choice)
        if key not in self._divides:
            self._divides[key] = self._divides_now(op, choice)
        return self._divides[key]

    def _divides_now(self, op: OpHandle, choice: Choice) -> bool:
        sig, call = op.signature, self._calls[op.name]
        if sig.is_frozen(choice.label):
            return False
        if choice.block > 1 and sig.blockable(choice.label, call) is not None:
            return False
        return sig.divides(choice.label, self.n, call, choice.block)

    def required(self, op: OpHandle, choice: Choice) -> tuple[list[TPLayout], list[Optional[TPLayout]]]:
        """The layouts the op's pieces read and write under `choice` (the lowering's reading of a plan).
        A function of the op and the choice alone: answered once each (the walk and its look-aheads
        ask again for every op they pass)."""
        key = (op.name, choice)
        if key not in self._required:
            self._required[key] = self._required_now(op, choice)
        return self._required[key]

    def _required_now(self, op: OpHandle, choice: Choice) -> tuple[list[TPLayout], list[Optional[TPLayout]]]:
        sig, node = op.signature, op.node
        if choice.label is None:
            return ([REPLICATED] * len(node.inputs),
                    [None if o is None else REPLICATED for o in node.outputs])
        label = choice.label
        ins: list[TPLayout] = []
        for i, labels in enumerate(sig.inputs):
            sig_block = self._sig_block(sig, label, i)
            host = merged_host(sig, label, labels)
            ins.append(_of_digit(label_digit(sig, label, labels, False, i),
                                 host[1] * choice.block if host else sig_block if sig_block > 1 else choice.block))
        outs: list[Optional[TPLayout]] = []
        for j, name in enumerate(node.outputs):
            labels = sig.outputs[j] if j < len(sig.outputs) else None
            host = merged_host(sig, label, labels)
            outs.append(None if name is None else _of_digit(label_digit(sig, label, labels, True, j),
                                                            host[1] * choice.block if host else choice.block))
        return ins, outs

    # -- local choice -------------------------------------------------------------------------------
    def current(self, value: str, pending: Optional[dict[str, TPLayout]] = None) -> Optional[TPLayout]:
        if pending is not None and value in pending:
            return pending[value]
        if self._is_static(value):
            return self.stored.get(value)
        return self.layout.get(value)

    def candidates(self, op: OpHandle, current: list[Optional[TPLayout]]) -> list[Choice]:
        blocks = {1}
        if self.blocked:
            blocks |= {c.block for c in current if c is not None and c.kind is TPKind.SPLIT}
        out = [REPLICATE]
        for label in op.signature.splittable():
            for b in sorted(blocks):
                c = Choice(label, b)
                if self.divides(op, c):
                    out.append(c)
        return out

    def cost(self, op: OpHandle, choice: Choice, current: list[Optional[TPLayout]]) -> list[int]:
        ins, _ = self.required(op, choice)
        return [conversion_cost(c, r) for c, r in zip(current, ins)]

    def best(self, op: OpHandle, current: list[Optional[TPLayout]]) -> Choice:
        """The cheapest choice; ties go to running whole, then to the smaller block factor."""
        def key(c: Choice) -> tuple:
            return (sum(self.cost(op, c, current)), c.label is not None, c.block)
        return min(self.candidates(op, current), key=key)

    def _partial_ends_path(self, op: OpHandle, choice: Choice) -> bool:
        """A partial sum is an acceptable end of a column split only where Megatron would have one."""
        anchor = self.matmul_anchor(op)
        if anchor is not None and choice.label == anchor.k:
            return True
        return choice.label in op.signature.comm_labels

    # -- look-ahead -----------------------------------------------------------------------------------
    def simulate(self, start: OpHandle, choice: Choice, seed: bool = False) -> Lookahead:
        """Follow the split outputs of `start` forward with the same local choices the walk makes.

        ok when every path reaches a row-parallel matmul, a group-aware kernel or a model output
        without a gather; otherwise `stop` is the op where a path stopped and `demand` the
        choice (a blocked split) it would have accepted instead, if there is one.

        With `seed`, a split that starts at an op that is not a matmul (see `_seed_candidates`)
        must end in a row-parallel matmul or a group-aware kernel: reaching another matmul that
        would not reduce over it, or a model output, means it is not a tensor-parallel path
        (a batch or sequence split that would spread over the rest of the model).
        """
        pending: dict[str, TPLayout] = {}
        ends: list[OpHandle] = []
        frontier: set[str] = set()
        horizon = -1  # position of the last op that reads a split value; nothing after it matters
        _, outs = self.required(start, choice)
        for name, lay in zip(start.node.outputs, outs):
            if name is not None and lay is not None:
                pending[name] = lay
                if lay.kind is TPKind.SPLIT:
                    frontier.add(name)
                    horizon = max(horizon, self._last_use.get(name, -1))
        for op in self.ops[self.position[start.name] + 1:]:
            if self.position[op.name] > horizon:
                break
            affected = [i for i, v in enumerate(op.node.inputs) if v in frontier]
            if not affected:
                continue
            current = [self.current(v, pending) for v in op.node.inputs]
            c = self.best(op, current)
            costs = self.cost(op, c, current)
            if any(costs[i] for i in affected):
                return Lookahead(False, op, self._demanded_split(op, current, affected))
            anchor = self.matmul_anchor(op)
            if seed and anchor is not None and c.label != anchor.k:
                return Lookahead(False, op)
            _, outs = self.required(op, c)
            for name, lay in zip(op.node.outputs, outs):
                if name is None or lay is None:
                    continue
                pending[name] = lay
                if lay.kind is TPKind.SPLIT:
                    if seed and name in self.graph.outputs:
                        return Lookahead(False, op)
                    frontier.add(name)
                    horizon = max(horizon, self._last_use.get(name, -1))
                elif lay.kind is TPKind.PARTIAL:
                    if not self._partial_ends_path(op, c):
                        return Lookahead(False, op)
                    ends.append(op)
        return Lookahead(bool(ends) or not seed, ends=tuple(ends))

    def _demanded_split(self, op: OpHandle, current: list[Optional[TPLayout]], affected: list[int]) -> Optional[Choice]:
        """A split of `op` that takes the stopped inputs on the same dim, only with another block factor."""
        for label in op.signature.splittable():
            if not self.divides(op, Choice(label)):
                continue
            ins, _ = self.required(op, Choice(label))
            wants = set()
            for i in affected:
                cur, req = current[i], ins[i]
                if req.kind is not TPKind.SPLIT or cur is None or cur.kind is not TPKind.SPLIT or req.dim != cur.dim:
                    break
                wants.add(req.block)
            else:
                if len(wants) == 1 and next(iter(wants)) > 1:
                    return Choice(label, next(iter(wants)))
        return None

    def _try_column(self, op: OpHandle, anchor: MatmulAnchor) -> Optional[Choice]:
        queue, tried = [1], set()
        while queue:
            b = queue.pop(0)
            if b in tried:
                continue
            tried.add(b)
            c = Choice(anchor.n, b)
            if not self.divides(op, c):
                continue
            result = self.simulate(op, c)
            if result.ok:
                return c
            if result.stop is not None:
                self.stopped.setdefault(op.name, result.stop)
            if result.demand is not None:
                if self.blocked:
                    queue.append(result.demand.block)
                else:
                    # The core cannot record a blocked matmul split: the matmul stays whole and
                    # the op that wanted the blocks may start the split itself (a local slice).
                    self.seeds[result.stop.name] = Choice(result.demand.label)
        return None

    def _seed_candidates(self, op: OpHandle, current: list[Optional[TPLayout]]) -> Optional[Choice]:
        """A split that starts here, on whole inputs, and reaches a row-parallel matmul.

        Tried on the ops after a matmul whose column split could not travel (its outputs are
        whole): a fused projection that capture could not cut into one matmul per section
        (capture/fused_sections.py recognizes contiguous cuts only) stays whole, but the query
        heads cut out of it can still be split by heads from the whole tensor (a local slice),
        with the key/value heads whole on every device as Megatron keeps them when there are
        fewer of them than devices; attention and the output projection then run split.
        """
        if any(c is not None and c.kind is not TPKind.REPLICATED for c in current):
            return None
        for c in self.candidates(op, current):
            if c.label is None or c.block > 1 or any(x == COMM for x in self.cost(op, c, current)):
                continue
            result = self.simulate(op, c, seed=True)
            if result.ok and not any(self._column_would_travel(end) for end in result.ends):
                return c
        return None

    def _column_would_travel(self, op: OpHandle) -> bool:
        """Whether a matmul fed whole could run column-parallel itself (what `_try_column` checks,
        without recording anything): then a split started before it would take its place."""
        anchor = self.matmul_anchor(op)
        if anchor is None or anchor.n is None:
            return False
        blocks, tried = [1], set()
        while blocks:
            b = blocks.pop()
            tried.add(b)
            c = Choice(anchor.n, b)
            if not self.divides(op, c):
                continue
            result = self.simulate(op, c)
            if result.ok:
                return True
            if result.demand is not None and self.blocked and result.demand.block not in tried:
                blocks.append(result.demand.block)
        return False

    def _try_seed(self, op: OpHandle, seed: Choice, current: list[Optional[TPLayout]]) -> Optional[Choice]:
        """Split an op whose inputs are whole, when its split outputs reach row-parallel partners."""
        if any(c == COMM for c in self.cost(op, seed, current)):
            return None
        return seed if self.simulate(op, seed).ok else None

    # -- embeddings -------------------------------------------------------------------------------------
    def _vocab_tables_to_split(self) -> set[str]:
        """Embedding ops to split along the vocabulary: the largest table of each group summed together."""
        embeds = [op for op in self.ops if self.vocab_anchor(op) is not None
                  and self.divides(op, Choice(self.vocab_anchor(op).label))]
        if self.n == 1 or not embeds:
            return set()
        reach = {op.name: self._linear_reach(op) for op in embeds}
        parent = {op.name: op.name for op in embeds}

        def root(x: str) -> str:
            while parent[x] != x:
                x = parent[x]
            return x

        for i, a in enumerate(embeds):
            for bop in embeds[i + 1:]:
                if reach[a.name] & reach[bop.name]:
                    parent[root(bop.name)] = root(a.name)
        largest: dict[str, OpHandle] = {}
        for op in embeds:
            r = root(op.name)
            if r not in largest or self._table_size(op) > self._table_size(largest[r]):
                largest[r] = op
        return {op.name for op in largest.values()}

    def _table_size(self, op: OpHandle) -> int:
        return self.graph.meta(op.node.inputs[self.vocab_anchor(op).weight]).numel

    def _linear_reach(self, op: OpHandle, limit: int = 16) -> set[str]:
        """Ops reached from `op`'s output through ops a partial sum could flow through."""
        seen: set[str] = set()
        frontier = [v for v in op.node.outputs if v is not None]
        while frontier and len(seen) < limit:
            v = frontier.pop()
            for c in self._consumers.get(v, ()):
                if c.name in seen:
                    continue
                seen.add(c.name)
                idx = c.node.inputs.index(v)
                dynamic = [x for x in c.node.inputs if not self._is_static(x)]
                if idx in c.signature.value_inputs or len(dynamic) == 1:
                    frontier.extend(o for o in c.node.outputs if o is not None)
        return seen

    # -- the walk -----------------------------------------------------------------------------------------
    def decide(self, op: OpHandle) -> Choice:
        if self.n == 1 or not any(o is not None for o in op.node.outputs):
            return REPLICATE
        current = [self.current(v) for v in op.node.inputs]
        anchor = self.matmul_anchor(op)
        if anchor is not None:
            act = current[anchor.activation]
            if act is not None and act.kind is TPKind.REPLICATED and anchor.n is not None:
                c = self._try_column(op, anchor)
                self.roles[op.name] = "column" if c else "replicated"
                if c is None and op.name in self.stopped:
                    self.whole_after_matmul.update((o, 0) for o in op.node.outputs if o is not None)
                return c or REPLICATE
            c = self.best(op, current)
            if c.label is None:
                self.roles[op.name] = "replicated"
            else:
                self.roles[op.name] = "row" if c.label == anchor.k else "column" if c.label == anchor.n else "other"
            return c
        vocab = self.vocab_anchor(op)
        if vocab is not None and op.name in self.vocab_split:
            return Choice(vocab.label)
        if op.name in self.seeds:
            c = self._try_seed(op, self.seeds[op.name], current)
            if c is not None:
                return c
        c = self.best(op, current)
        hops = [self.whole_after_matmul[v] for v in op.node.inputs if v in self.whole_after_matmul]
        if c.label is None and hops:
            seeded = self._seed_candidates(op, current)
            if seeded is not None:
                return seeded
            if min(hops) < SEED_HOPS:
                self.whole_after_matmul.update((o, min(hops) + 1) for o in op.node.outputs if o is not None)
        return c

    def _pull_into_weight_view(self, value: str, wanted: TPLayout) -> None:
        """Make the ops that turn a parameter into `value` (a transpose, a cast) produce it as
        `wanted`, so a matmul splitting a weight view reads its chunk without a slice of a whole
        copy (and its gradient needs no gather): the parameter itself is then stored split."""
        v = self.graph.values[value]
        if v.kind != "op" or v.producer is None or len(self._consumers.get(value, ())) != 1:
            return
        if weight_source(self.graph, value) is None:
            return
        producer = next((op for op in self.ops if op.name == v.producer), None)
        if producer is None or self.choices.get(producer.name) != REPLICATE:
            return
        for c in self.candidates(producer, [None] * len(producer.node.inputs)):
            if c.label is None:
                continue
            ins, outs = self.required(producer, c)
            if outs[0] != wanted:
                continue
            src = producer.node.inputs[0]
            if self._is_static(src):
                if len(self._consumers.get(src, ())) != 1:
                    return
                self.stored[src] = ins[0]
            else:
                self._pull_into_weight_view(src, ins[0])
                if self.layout.get(src) != ins[0]:
                    return
            self.choices[producer.name] = c
            self.layout[value] = wanted
            return

    def run(self) -> dict[str, Choice]:
        for op in self.ops:
            c = self.decide(op)
            self.choices[op.name] = c
            ins, outs = self.required(op, c)
            for v, req in zip(op.node.inputs, ins):
                if (req.kind is TPKind.SPLIT and not self._is_static(v)
                        and self.layout.get(v) == REPLICATED):
                    self._pull_into_weight_view(v, req)
            for v, req in zip(op.node.inputs, ins):
                if self._is_static(v) and v not in self.stored:
                    self.stored[v] = REPLICATED if req.kind is TPKind.PARTIAL else req
            for v, lay in zip(op.node.outputs, outs):
                if v is not None and lay is not None:
                    self.layout[v] = lay
        return self.choices

    def weight_dims(self) -> list[tuple[OpHandle, str, int, bool]]:
        """(op, label, size, divisible) of every weight dim tensor parallelism could split: the
        output features and the reduce dim of each matmul with a weight, the vocabulary of each
        lookup; divisible says whether the degree divides it (in blocks where the rule wants them,
        so a fused QKV of 3 x 64 does not count as divisible by 3)."""
        out = []
        for op in self.ops:
            a, v = self.matmul_anchor(op), self.vocab_anchor(op)
            if a is not None:
                weight, labels = a.weight, [a.n, a.k]
            elif v is not None:
                weight, labels = v.weight, [v.label]
            else:
                continue
            shape = self.graph.meta(op.node.inputs[weight]).shape
            for label in labels:
                dims = [d for d, l in enumerate(op.signature.inputs[weight] or ()) if l == label]
                if label is None or not dims:
                    continue
                blocks = {1, self._sig_block(op.signature, label)} if self.blocked else {1}
                divisible = any(self.divides(op, Choice(label, b)) for b in blocks)
                out.append((op, label, shape[dims[0]], divisible))
        return out

    def check_something_split(self) -> None:
        """A tensor-parallel degree under which no weight is split is refused: every op would run
        whole on every device, which looks like tensor parallelism and is not."""
        if self.n <= 1 or any(c.label is not None for c in self.choices.values()):
            return
        dims = self.weight_dims()
        if not dims:
            return
        sizes = sorted({size for _, _, size, _ in dims})
        shown = f"{', '.join(map(str, sizes[:12]))}{' ...' if len(sizes) > 12 else ''}"
        fits = [d for d in range(2, max(sizes) + 1)
                if d != self.n and sum(size % d == 0 for size in sizes) * 2 >= len(sizes)]
        advice = (f"Choose a degree that divides them (for example {fits[0]}), or use data parallelism (dp)" if fits
                  else "Use data parallelism (dp) for this model")
        if not any(divisible for *_, divisible in dims):
            raise PlanError(f"tensor-parallel degree {self.n} divides none of the weight dims of "
                            f"{self.graph.model_class} (sizes {shown}; first weight at {dims[0][0].node.where()}), "
                            f"so every op would run whole on every device. {advice}")
        stop = next(iter(self.stopped.values()), None)
        where = ""
        if stop is not None:
            shapes = ", ".join(str(list(self.graph.meta(v).shape)) for v in stop.node.inputs)
            where = f" The first split stops at {stop.node.where()} (inputs {shapes}), which cannot take it."
        raise PlanError(f"tensor parallelism over {self.n} devices splits no weight of {self.graph.model_class}: "
                        f"the ops between its matmuls (weight dims {shown}) cannot be split {self.n} ways.{where} "
                        f"{advice}, or add dimension rules for the ops in between")

    def apply(self) -> None:
        """Record the choices on the builder: piece i of every split op runs on device i."""
        if not self.choices:
            self.run()
        self.check_something_split()
        b = self.builder
        for op in self.ops:
            c = self.choices[op.name]
            devices = self.devices_of(op)
            if c.label is None:
                b.replicate(op, devices=devices)
                continue
            subs = b.op_trans(op, dim=c.label, num=self.n, block=c.block)
            for device, sub in zip(devices, subs):
                b.op_assign(sub, device)

    def summary(self) -> Counter:
        """Matmul roles (column/row/replicated) plus split/replicated counts of all ops."""
        c = Counter(self.roles.values())
        c["split_ops"] = sum(1 for ch in self.choices.values() if ch.label is not None)
        c["replicated_ops"] = sum(1 for ch in self.choices.values() if ch.label is None)
        return c


# -- plan-level checks --------------------------------------------------------------------------------------
def partial_to_whole(graph: Graph, plan: Plan) -> list[tuple[str, str]]:
    """(value, consumer) pairs where a partial-sum output is read by something that needs it summed.

    Read from the plan and the rules alone, independently of how the plan was made, so it counts
    the all-reduces (or reduce-scatters) of activations that the lowering will have to insert;
    each value is counted once however many consumers need it summed. Model outputs count as
    consumers that need whole tensors.
    """
    partial: dict[str, bool] = {}
    found: dict[str, str] = {}
    for op in graph.ops:
        p = plan.ops[op.name]
        sig = signature_for(graph, op)
        for i, name in enumerate(op.inputs):
            if not partial.get(name):
                continue
            labels = sig.inputs[i]
            takes_partial = any(label_digit(sig, l, labels, False, i).kind is DigitKind.PARTIAL for l, _ in p.splits)
            if not takes_partial and name not in found:
                found[name] = op.name
        for j, name in enumerate(op.outputs):
            if name is None:
                continue
            labels = sig.outputs[j] if j < len(sig.outputs) else None
            partial[name] = any(label_digit(sig, l, labels, True, j).kind is DigitKind.PARTIAL for l, _ in p.splits)
    for name in graph.outputs:
        if name is not None and partial.get(name) and name not in found:
            found[name] = "<model output>"
    return list(found.items())


def matmul_roles(builder: PlanBuilder, plan: Plan) -> dict[str, str]:
    """Per matmul with a weight parameter: "column", "row", "replicated" or "other", read from a plan."""
    out: dict[str, str] = {}
    for op in builder.ops:
        anchor = matmul_anchor(builder.graph, op.node, op.signature)
        if anchor is None:
            continue
        labels = {l for l, _ in plan.ops[op.name].splits}
        if not labels:
            out[op.name] = "replicated"
        elif labels == {anchor.k}:
            out[op.name] = "row"
        elif labels == {anchor.n}:
            out[op.name] = "column"
        else:
            out[op.name] = "other"
    return out


def matmul_flops(graph: Graph, op) -> int:
    """Multiply-add FLOPs of an op that contracts a dim (a reduce label two of its inputs carry:
    linear, the matmuls, convolutions, grouped expert matmuls) or of attention; 0 for every other op.

    2 x (elements of the first output) x (length of every contracted dim); attention counts its
    two products, 2 x B.H.L.S.(E + Ev).
    """
    sig = signature_for(graph, op)
    call = op_call(graph, op)
    if "scaled_dot_product_attention" in str(op.target) and call.inputs[0].ndim >= 2:
        q, k, v = call.inputs[:3]
        return 2 * (q.numel // q.shape[-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    # contracted: a reduce label two float inputs carry (a mean or a lookup reduces over one
    # input only; a loss reads its labels as integers)
    reduce = [l for l in sig.reduce
              if len({i for i, _ in sig.dims_of(l)[0] if call.inputs[i].dtype.is_floating_point}) >= 2]
    out = call.outputs[0] if call.outputs else None
    if not reduce or out is None:
        return 0
    k = 1
    for l in dict.fromkeys(reduce):
        ins, _ = sig.dims_of(l)
        if ins:
            i, d = ins[0]
            k *= call.inputs[i].shape[d]
    return 2 * out.numel * k


def split_matmul_flops(graph: Graph, plan: Plan) -> tuple[int, int]:
    """(FLOPs of matmuls the plan splits, FLOPs of all matmuls): how tensor parallel a plan is.

    A matmul counts as split when its op is split along any label (its FLOPs are then divided
    among the pieces); one that runs whole on every device of the unit is not split.
    """
    done = total = 0
    for op in graph.ops:
        f = matmul_flops(graph, op)
        total += f
        if f and plan.ops[op.name].splits:
            done += f
    return done, total


def apply_tp(par: Parallelization, axes: Sequence[str] = ("tp",), check: str = "each") -> dict[str, Choice]:
    """Megatron tensor parallelism found by propagation (`TensorParallelPropagation`) along `axes`
    of the mesh, in every pipeline stage over that stage's devices (a stage every rank shares, the
    interlaced pipeline's embedding and head, over all the unit's devices). Recorded on `par`;
    returns every op's choice.

    `check`: "each" refuses a stage in which no weight is split (a degree that divides none of its
    weight dims would run every op whole on every device, which looks like tensor parallelism and is
    not); "any" refuses only when no stage splits one; "none" checks nothing."""
    builder = par.builder
    found: dict[str, Choice] = {}
    split_somewhere = False
    for ops, rank in par.segments():
        shared = par.stages is not None and rank is None

        def names_of(op: OpHandle) -> list[str]:
            view = par.view_of(op)
            return [n for n, _ in view] if shared else [n for n in axes if n in dict(view)]

        # ops whose view has the axes take part (an experts op of an ep plan sees its own axes)
        taking = [op for op in ops if names_of(op)]
        if not taking:
            continue
        degree = math.prod(s for n, s in par.view_of(taking[0]) if n in names_of(taking[0]))
        if degree <= 1:
            continue
        prop = TensorParallelPropagation(builder, degree=degree, ops=None if par.stages is None else ops)
        choices = prop.run()
        if check == "each":
            prop.check_something_split()
        for op in taking:
            c = choices[op.name]
            found[op.name] = c
            if c.label is not None:
                split_somewhere = True
                par.split(op, names_of(op), c.label, c.block)
    if check == "any" and not split_somewhere and any(par.degree(a) > 1 for a in axes):
        degree = math.prod(par.degree(a) for a in axes)
        raise PlanError(f"tensor parallelism over {degree} devices splits no weight of any pipeline stage of "
                        f"{builder.graph.model_class}; choose a tp that divides its weight dims, or tp=1")
    return found
