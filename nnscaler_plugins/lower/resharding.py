"""The cheapest way to move a tensor from one layout to another, and running it on each rank.

The search is Dijkstra over layouts. Every move takes one factor out of a digit of the position
(replica r, value v or piece d_i) and puts it in another: all-gather (D->R), all-reduce (V->R),
reduce-scatter (V->D), local chunk (R->D), value mask (R->V) and all-to-all (D on one dim -> D on
another). Devices that differ only in the moved factor form one subgroup, ordered by it, so the
device order of the result follows from the digits. States are told apart by what each device
holds, not by device order (replica and summand labels carry no data), which keeps the search
small and lets a path end in the target's data under another order. Where only the order is off,
a permutation (point-to-point) finishes the job; local chunks and masks read off the target avoid
most of those. Pieces are only cut finer where the target cuts them, which prunes paths that would
have to gather them again.

Tensors moving between different device sets (pipeline stages) are made whole on the source
devices, sent whole to the destination devices that lack them, then cut locally.
"""
from __future__ import annotations

import enum
import functools
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Union

import torch

from nnscaler_plugins.layout import Layout
from nnscaler_plugins.kernels import collectives as C

ALPHA = 1e-5            # seconds per collective call
BETA = 1.0 / 10e9       # seconds per byte
ITEMSIZE = 4            # costs assume fp32; only the ranking of paths matters
LOCAL_COST = 1e-9       # local steps are nearly free; this keeps paths short

_R, _V = 0, 1           # digit indices; dim i is digit 2 + i


class StepKind(str, enum.Enum):
    """One move of a resharding. A str, so a kind compares (and counts) equal to its name."""

    ALL_GATHER = "all-gather"          # D -> R
    ALL_REDUCE = "all-reduce"          # V -> R
    REDUCE_SCATTER = "reduce-scatter"  # V -> D
    CHUNK = "chunk"                    # R -> D, local
    VALUE_MASK = "value-mask"          # R -> V, local
    ALL_TO_ALL = "all-to-all"          # D on one dim -> D on another
    PERMUTE = "permute"                # point-to-point: the same pieces on other devices
    SEND = "send"                      # point-to-point: whole tensors to another device set

    # Printed, formatted and hashed as its name, on every Python version (tables keyed by name find it).
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def communicates(self) -> bool:
        return self not in (StepKind.CHUNK, StepKind.VALUE_MASK)

    @property
    def point_to_point(self) -> bool:
        return self in (StepKind.PERMUTE, StepKind.SEND)


COMMUNICATING = tuple(k for k in StepKind if k.communicates)

# What `Step.describe` says of a step over subgroups (generated code carries it in comments);
# point-to-point steps list their pairs.
_DESCRIPTIONS = {
    StepKind.ALL_GATHER: "all-gather dim {dim} over groups {groups}",
    StepKind.REDUCE_SCATTER: "reduce-scatter dim {dim} over groups {groups}",
    StepKind.ALL_REDUCE: "all-reduce over groups {groups}",
    StepKind.CHUNK: "chunk dim {dim} locally over groups {groups}",
    StepKind.VALUE_MASK: "value-mask (first keeps the value) over groups {groups}",
    StepKind.ALL_TO_ALL: "all-to-all dim {dim} -> dim {dim2} over groups {groups}",
}


@dataclass(frozen=True)
class Step:
    kind: StepKind
    src: Layout
    dst: Layout
    groups: tuple[tuple[int, ...], ...]   # subgroups, members in piece (factor) order
    dim: Optional[int] = None
    dim2: Optional[int] = None            # all-to-all: the dim the split moves to
    elements: int = 0                      # elements each device sends (or receives)

    @property
    def bytes_per_device(self) -> int:
        return self.elements * ITEMSIZE

    @property
    def group_size(self) -> int:
        return 2 if self.kind.point_to_point else max((len(g) for g in self.groups), default=1)

    def describe(self) -> str:
        if self.kind.point_to_point:
            return f"{self.kind.value} " + ", ".join(f"{a}->{b}" for a, b in self.groups)
        return _DESCRIPTIONS[self.kind].format(dim=self.dim, dim2=self.dim2, groups=[list(g) for g in self.groups])

    def apply(self, x: Optional[torch.Tensor], rank: int, groups: Any) -> Optional[torch.Tensor]:
        """This rank's part of the step; `groups.get(ranks)` gives process groups."""
        if rank not in self.src.group and rank not in self.dst.group:
            return x  # across device sets, each side only takes part in its own steps
        if self.kind.point_to_point:
            glob = getattr(groups, "global_rank", lambda d: d)
            send_to = [glob(b) for a, b in self.groups if a == rank]
            recv_from = [glob(a) for a, b in self.groups if b == rank]
            return _POINT_TO_POINT[self.kind](self, x, rank, send_to, recv_from)
        members = next((g for g in self.groups if rank in g), None)
        if members is None:
            raise RuntimeError(f"device {rank} takes no part in '{self.describe()}'")
        ranked = sorted(members)
        order = tuple(ranked.index(m) for m in members)
        return _COLLECTIVE[self.kind](self, x, members.index(rank), groups.get(members), order)


# How each rank runs a step: (step, x, index of the rank in its subgroup, process group, subgroup order).
_COLLECTIVE: dict[StepKind, Callable[..., Optional[torch.Tensor]]] = {
    StepKind.ALL_GATHER: lambda s, x, i, pg, order: C.all_gather(x, s.dim, pg, s.src.blocks[s.dim], order),
    StepKind.ALL_REDUCE: lambda s, x, i, pg, order: C.all_reduce(x, pg),
    StepKind.REDUCE_SCATTER: lambda s, x, i, pg, order: C.reduce_scatter(x, s.dim, pg, s.dst.blocks[s.dim], order),
    StepKind.CHUNK: lambda s, x, i, pg, order: C.chunk(x, s.dim, pg, s.dst.blocks[s.dim], order),
    StepKind.VALUE_MASK: lambda s, x, i, pg, order: C.value_mask(x, i == 0),
    StepKind.ALL_TO_ALL: lambda s, x, i, pg, order: C.all_to_all(x, s.dim, s.dim2, pg, s.src.blocks[s.dim],
                                                                 s.dst.blocks[s.dim2], order),
}
# Point-to-point steps: (step, x, rank, global ranks it sends to, global ranks it receives from).
_POINT_TO_POINT: dict[StepKind, Callable[..., Optional[torch.Tensor]]] = {
    StepKind.PERMUTE: lambda s, x, rank, send_to, recv_from: C.send_recv(x, send_to[0], recv_from[0]),
    StepKind.SEND: lambda s, x, rank, send_to, recv_from: C.transfer(
        x, send_to, recv_from[0] if recv_from else None, s.dst.local_shape(), keep=rank in s.dst.group),
}


@dataclass(frozen=True)
class ReshardPlan:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    cost: float

    @property
    def is_identity(self) -> bool:
        return not self.steps

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.steps) or "nothing to do"

    def count(self) -> Counter:
        """Communicating steps by kind name (local chunks and masks are not counted)."""
        return Counter(s.kind.value for s in self.steps if s.kind.communicates)

    def shape_free(self) -> tuple:
        """What the runtime does, less the sizes: a program generated at other input sizes may
        reuse this plan only where this agrees (a split through a dim merged with a varying size
        changes a block count, which the sizes alone do not carry)."""
        def lay(x: Layout) -> tuple:
            return x.group, x.replicas, x.partial, x.splits, x.blocks

        return tuple((s.kind.value, s.dim, s.dim2, s.groups, lay(s.src), lay(s.dst)) for s in self.steps)

    def groups_needed(self) -> set[tuple[int, ...]]:
        """Subgroups the steps' collectives run over (value masks and point-to-point need none)."""
        return {tuple(sorted(g)) for s in self.steps if s.kind is not StepKind.VALUE_MASK and not s.kind.point_to_point
                for g in s.groups if len(g) > 1}

    def apply(self, x_local: Optional[torch.Tensor], rank: int, groups: Any) -> Optional[torch.Tensor]:
        for step in self.steps:
            x_local = step.apply(x_local, rank, groups)
        return x_local


def default_cost(step: Step) -> float:
    if not step.kind.communicates:
        return LOCAL_COST
    return ALPHA + BETA * step.bytes_per_device


def plan(src: Layout, dst: Layout, cost_fn: Optional[Callable[[Step], float]] = None) -> ReshardPlan:
    """Cheapest steps turning `src` into `dst` (cached by layouts and cost function)."""
    if src.shape != dst.shape:
        raise ValueError(f"cannot reshard between shapes {src.shape} and {dst.shape}")
    return _plan(src, dst, cost_fn or default_cost)


@functools.lru_cache(maxsize=4096)
def _plan(src: Layout, dst: Layout, cost_fn: Callable[[Step], float]) -> ReshardPlan:
    if set(src.group) == set(dst.group):
        steps, cost = _search(src, dst, cost_fn)
        return ReshardPlan(src, dst, tuple(steps), cost)
    whole_src = Layout.replicated(src.shape, src.group)
    whole_dst = Layout.replicated(dst.shape, dst.group)
    first, second = _plan(src, whole_src, cost_fn), _plan(whole_dst, dst, cost_fn)
    move = _transfer(whole_src, whole_dst)
    return ReshardPlan(src, dst, first.steps + (move,) + second.steps, first.cost + cost_fn(move) + second.cost)


# -- search ---------------------------------------------------------------------------------------------
def _normal(lay: Layout) -> Layout:
    """Block factors of unsplit dims mean nothing; drop them so equal data means equal states."""
    blocks = tuple(b if n > 1 else 1 for n, b in zip(lay.splits, lay.blocks))
    return lay if blocks == lay.blocks else replace(lay, blocks=blocks)


@functools.lru_cache(maxsize=65536)
def _table(lay: Layout) -> tuple[tuple[int, ...], ...]:
    """Every position's digits (r, v, d0, ...), computed once per layout."""
    return tuple((r, v, *d) for r, v, d in map(lay.digits, range(lay.num_devices)))


@functools.lru_cache(maxsize=65536)
def _key(lay: Layout) -> tuple:
    """What every device holds, up to replica and summand labels."""
    classes: dict[tuple, list[int]] = {}
    for rank, digits in zip(lay.group, _table(lay)):
        classes.setdefault(digits[1:], []).append(rank)
    return lay.splits, _normal(lay).blocks, frozenset((vd[1:], frozenset(m)) for vd, m in classes.items())


def _search(src: Layout, dst: Layout, cost_fn: Callable[[Step], float]) -> tuple[list[Step], float]:
    start, goal = _normal(src), _normal(dst)
    target = _key(goal)
    # One concrete layout per distinct data placement (the cheapest found) keeps the search small.
    best = {_key(start): (0.0, start)}
    back: dict[tuple, tuple[tuple, Step]] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    while heap:
        cost, _, lay = heapq.heappop(heap)
        key = _key(lay)
        if best[key][1] is not lay:
            continue
        if key == target:
            steps = []
            while key in back:
                key, step = back[key]
                steps.append(step)
            return steps[::-1], cost
        for step in _moves(lay, goal, target):
            new, new_key = cost + cost_fn(step), _key(step.dst)
            if new < best.get(new_key, (math.inf,))[0]:
                best[new_key] = (new, step.dst)
                back[new_key] = (key, step)
                heapq.heappush(heap, (new, next(tie), step.dst))
    raise AssertionError(f"no way found from {src} to {dst}")  # a permutation always exists


def _divisors(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if n % k == 0]


def _structure(lay: Layout) -> tuple:
    return lay.replicas, lay.partial, lay.splits, lay.blocks


def _moves(lay: Layout, goal: Layout, target: tuple) -> Iterator[Step]:
    """Every move from `lay`; pieces are only cut finer (or summands split) where the goal has them."""
    dims = range(lay.ndim)
    both = ("lo", "hi")
    finer = [goal.splits[i] // lay.splits[i] if goal.splits[i] % lay.splits[i] == 0 else 1 for i in dims]
    more_partial = goal.partial // lay.partial if goal.partial % lay.partial == 0 else 1
    yield from _goal_moves(lay, goal)  # first, so that ties go to the target's own device order
    for i in dims:
        for k in _divisors(lay.splits[i]):
            for into in both:
                yield _move(lay, StepKind.ALL_GATHER, 2 + i, "lo", _R, into, k, dim=i)
    for k in _divisors(lay.partial):
        for take, into in itertools.product(both, both):
            yield _move(lay, StepKind.ALL_REDUCE, _V, take, _R, into, k)
        for i in dims:
            if finer[i] % k == 0:
                for take in both:
                    yield from _split_moves(lay, goal, StepKind.REDUCE_SCATTER, _V, take, k, i, dim=i)
    for k in _divisors(lay.replicas):
        for take in both:
            for i in dims:
                if finer[i] % k == 0:
                    yield from _split_moves(lay, goal, StepKind.CHUNK, _R, take, k, i, dim=i)
            if more_partial % k == 0:
                for into in both:
                    yield _move(lay, StepKind.VALUE_MASK, _R, take, _V, into, k)
    for a, b in itertools.product(dims, dims):
        if a != b:
            for k in _divisors(lay.splits[a]):
                if finer[b] % k == 0:
                    yield from _split_moves(lay, goal, StepKind.ALL_TO_ALL, 2 + a, "lo", k, b, dim=a, dim2=b)
    if _structure(lay) == _structure(goal) and _key(lay) != target:
        yield Step(StepKind.PERMUTE, lay, goal, tuple(zip(lay.group, goal.group)),
                   elements=math.prod(lay.local_shape()))


def _split_moves(lay: Layout, goal: Layout, kind: StepKind, src_digit: int, take: str, k: int, i: int,
                 **dims: int) -> Iterator[Step]:
    """Moves that add a factor k to the split of dim i, under every block factor that fits."""
    options = {lay.blocks[i]} if lay.splits[i] > 1 else {1, goal.blocks[i]}
    for blocks in sorted(options):
        if lay.shape[i] % (lay.splits[i] * k * blocks) == 0:
            yield _move(lay, kind, src_digit, take, 2 + i, "lo", k, blocks=blocks, **dims)


def _goal_moves(lay: Layout, goal: Layout) -> Iterator[Step]:
    """Local chunks and masks that hand each device the piece the goal gives it.

    Replica and summand labels are free, so the digit-wise moves may leave pieces on the right
    number of devices but the wrong ones; reading the assignment off the goal avoids a permutation.
    """
    here = dict(zip(lay.group, _table(lay)))
    there = dict(zip(goal.group, _table(goal)))
    for i in range(lay.ndim):
        k, d = goal.splits[i] // lay.splits[i], 2 + i
        if (k < 2 or goal.splits[i] != k * lay.splits[i] or lay.replicas % k
                or (lay.splits[i] > 1 and lay.blocks[i] != goal.blocks[i])):
            continue
        if all(there[r][d] // k == here[r][d] for r in lay.group):
            take = _assign(here, {r: there[r][d] % k for r in lay.group}, k)
            if take:
                yield _move(lay, StepKind.CHUNK, _R, take, d, "lo", k, dim=i, blocks=goal.blocks[i])
    k = goal.partial // lay.partial
    if k > 1 and goal.partial == k * lay.partial and lay.replicas % k == 0 \
            and all(here[r][2:] == there[r][2:] for r in lay.group):
        summands: dict[tuple, set[int]] = {}  # the goal's summands within each of ours
        for r in lay.group:
            summands.setdefault(here[r][1:], set()).add(there[r][_V])
        if all(len(v) == k for v in summands.values()):
            take = _assign(here, {r: sorted(summands[here[r][1:]]).index(there[r][_V]) for r in lay.group}, k)
            if take:
                yield _move(lay, StepKind.VALUE_MASK, _R, take, _V, "lo", k)


def _assign(here: dict[int, tuple], factor: dict[int, int], k: int) -> Optional[dict[int, tuple[int, int]]]:
    """(factor, new replica index) per device, if every replica set holds each factor equally often."""
    seen: dict[tuple, Counter] = {}
    out = {}
    for rank in sorted(factor):
        count = seen.setdefault(here[rank][1:], Counter())
        out[rank] = (factor[rank], count[factor[rank]])
        count[factor[rank]] += 1
    balanced = all(len(c) == k and len(set(c.values())) == 1 for c in seen.values())
    return out if balanced else None


def _move(lay: Layout, kind: StepKind, src_digit: int, take: Union[str, dict[int, tuple[int, int]]], dst_digit: int,
          into: str, k: int, dim: Optional[int] = None, dim2: Optional[int] = None,
          blocks: Optional[int] = None) -> Step:
    """Take factor k out of one digit and put it into another.

    `take` says which part of the source digit is the factor: its low or high part, or, for moves
    read off the goal, a given (factor, rest) per device. `into` says where the factor goes in the
    destination digit (a split digit always takes it low: pieces are cut within pieces)."""
    radices = list(lay.radices)
    old_src, old_dst = radices[src_digit], radices[dst_digit]
    radices[src_digit] //= k
    radices[dst_digit] *= k
    new_blocks = list(lay.blocks)
    if blocks is not None:
        new_blocks[dst_digit - 2] = blocks
    placed: list[int] = [0] * len(lay.group)
    subgroups: dict[tuple, list[tuple[int, int]]] = {}
    for rank, digits in zip(lay.group, _table(lay)):
        digits = list(digits)
        x = digits[src_digit]
        if isinstance(take, dict):
            f, rest = take[rank]
        else:
            f, rest = (x % k, x // k) if take == "lo" else (x // (old_src // k), x % (old_src // k))
        digits[src_digit] = rest
        subgroups.setdefault(tuple(digits), []).append((f, rank))
        y = digits[dst_digit]
        digits[dst_digit] = y * k + f if into == "lo" else f * old_dst + y
        pos = 0
        for digit, radix in zip(digits, radices):
            pos = pos * radix + digit
        placed[pos] = rank
    new = _normal(Layout(lay.shape, tuple(placed), radices[0], radices[1], tuple(radices[2:]), tuple(new_blocks)))
    groups = tuple(sorted(tuple(rank for _, rank in sorted(members)) for members in subgroups.values()))
    local = math.prod(lay.local_shape())
    elements = {StepKind.ALL_GATHER: (k - 1) * local, StepKind.ALL_REDUCE: 2 * (k - 1) * local // k,
                StepKind.REDUCE_SCATTER: (k - 1) * local // k, StepKind.ALL_TO_ALL: (k - 1) * local // k}.get(kind, 0)
    return Step(kind, lay, new, groups, dim=dim, dim2=dim2, elements=elements)


def _transfer(whole_src: Layout, whole_dst: Layout) -> Step:
    """Whole tensors to the destination devices that lack them, senders taken in turn."""
    senders = sorted(whole_src.group)
    missing = [t for t in whole_dst.group if t not in whole_src.group]
    pairs = tuple((senders[i % len(senders)], t) for i, t in enumerate(missing))
    busiest = -(-len(missing) // len(senders))
    return Step(StepKind.SEND, whole_src, whole_dst, pairs, elements=busiest * math.prod(whole_src.shape))
