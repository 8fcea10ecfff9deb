"""Pipeline schedules: for each pipeline rank, the ordered tasks of one training step.

A schedule is a plain function `fn(shape: PipelineShape, **options) -> list[list[Task]]` returning one
task list per pipeline rank. A task names a stage, a micro-batch and what to run: the forward
("F"), the backward ("B"), or, when the schedule splits backward as zero-bubble schedules do, the
input-gradient part ("B") and the weight-gradient part ("W") separately. Tasks are data, not code,
so the same lists drive the executor, the dry-run check (`timeline.check`), the simulator and the
rendered timeline: what a person looks at is what runs.

Stages are numbered in model order. With virtual stages (interleaved schedules) there are more
stages than ranks and `stage_rank` says which rank runs each; by default stage s runs on rank
s % ranks, so each rank holds every `ranks`-th chunk of the model. A stage whose rank is
`SHARED` (-1) runs on every rank at once, split across all their devices (the interlaced
pipeline's embedding and LM head): its tasks appear in every rank's list and start together.

Built-ins (registered by name in `SCHEDULES`): GPipe, 1F1B, interleaved 1F1B (Megatron's order)
and a zero-bubble schedule. A user's own function is checked the same way before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
SHARED = -1  # the stage_rank of a stage every rank runs together


@dataclass(frozen=True, order=True)
class Task:
    """One unit of pipeline work on one rank.

    `grad=False` marks a forward run under no_grad whose activations are not kept (a recycling
    pass); `round` tells apart several such passes over the same micro-batch.
    """

    stage: int
    micro_batch: int
    kind: str = FORWARD
    grad: bool = True
    round: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task kind must be one of {KINDS}, got {self.kind!r}")
        if not self.grad and self.kind != FORWARD:
            raise ValueError("only forward tasks can run without gradients")

    @property
    def key(self) -> tuple:
        return (self.stage, self.micro_batch, self.kind, self.grad, self.round)

    def __str__(self) -> str:
        extra = "" if self.grad else f"~{self.round}" if self.round else "~"
        return f"{self.kind}{self.stage}.{self.micro_batch}{extra}"

    def to_json(self) -> list:
        out: list = [self.kind, self.stage, self.micro_batch]
        if not self.grad:
            out += [False, self.round]
        return out

    @classmethod
    def from_json(cls, data: list) -> "Task":
        kind, stage, mb, *rest = data
        grad = bool(rest[0]) if rest else True
        rnd = int(rest[1]) if len(rest) > 1 else 0
        return cls(int(stage), int(mb), str(kind), grad, rnd)


@dataclass(frozen=True)
class PipelineShape:
    """What a schedule is asked to order: stages, the ranks they run on, and micro-batches."""

    num_stages: int
    num_ranks: int
    micro_batches: int
    stage_rank: tuple[int, ...] = field(default=())
    split_backward: bool = False

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_ranks < 1 or self.micro_batches < 1:
            raise ValueError(f"stages, ranks and micro-batches must be >= 1 (got {self.num_stages}, "
                             f"{self.num_ranks}, {self.micro_batches})")
        if not self.stage_rank:
            object.__setattr__(self, "stage_rank", tuple(s % self.num_ranks for s in range(self.num_stages)))
        if len(self.stage_rank) != self.num_stages:
            raise ValueError(f"stage_rank has {len(self.stage_rank)} entries for {self.num_stages} stages")
        if any(not (0 <= r < self.num_ranks or r == SHARED) for r in self.stage_rank):
            raise ValueError(f"stage_rank {self.stage_rank} names ranks outside 0..{self.num_ranks - 1}")

    @property
    def virtual(self) -> int:
        """Stages per rank when they are spread evenly (interleaving chunks)."""
        return self.num_stages // self.num_ranks

    def is_shared(self, stage: int) -> bool:
        return self.stage_rank[stage] == SHARED

    def stages_of(self, rank: int) -> list[int]:
        """The stages a rank runs: its own and the shared ones."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank or r == SHARED]


Schedule = Callable[..., list[list[Task]]]


def _require_one_stage_per_rank(shape: PipelineShape, name: str) -> None:
    if shape.num_stages != shape.num_ranks or shape.stage_rank != tuple(range(shape.num_ranks)):
        raise ValueError(f"the {name} schedule runs stage i on rank i ({shape.num_stages} stages on "
                         f"{shape.num_ranks} ranks given); use 'interleaved' for virtual stages")


def gpipe(shape: PipelineShape) -> list[list[Task]]:
    """All forwards, then all backwards: simple, and every micro-batch's activations are held at once."""
    out: list[list[Task]] = []
    for rank in range(shape.num_ranks):
        stages = shape.stages_of(rank)
        tasks = [Task(s, mb, FORWARD) for s in stages for mb in range(shape.micro_batches)]
        for s in reversed(stages):
            for mb in range(shape.micro_batches):
                tasks.append(Task(s, mb, BACKWARD))
                if shape.split_backward:
                    tasks.append(Task(s, mb, WEIGHT))
        out.append(tasks)
    return out


def one_f_one_b(shape: PipelineShape) -> list[list[Task]]:
    """PipeDream-flush / Megatron 1F1B: after a warm-up of (ranks - rank - 1) forwards each rank
    alternates one forward and one backward, so rank r holds at most ranks - r micro-batches."""
    _require_one_stage_per_rank(shape, "1f1b")
    p, m = shape.num_ranks, shape.micro_batches
    out = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        tasks = [Task(rank, mb, FORWARD) for mb in range(warmup)]
        for i in range(m - warmup):
            tasks.append(Task(rank, warmup + i, FORWARD))
            tasks += _backward(shape, rank, i)
        for mb in range(m - warmup, m):
            tasks += _backward(shape, rank, mb)
        out.append(tasks)
    return out


def _backward(shape: PipelineShape, stage: int, mb: int) -> list[Task]:
    if shape.split_backward:
        return [Task(stage, mb, BACKWARD), Task(stage, mb, WEIGHT)]
    return [Task(stage, mb, BACKWARD)]


def interleaved_1f1b(shape: PipelineShape) -> list[list[Task]]:
    """Megatron's interleaved 1F1B: each rank holds `virtual` model chunks (stage c * ranks + rank)
    and walks micro-batches in groups of `ranks`, chunk by chunk; the bubble shrinks by the number
    of chunks at the price of more point-to-point traffic. Needs micro-batches divisible by ranks."""
    p, m = shape.num_ranks, shape.micro_batches
    v = shape.virtual
    if shape.num_stages != p * v or shape.stage_rank != tuple(s % p for s in range(shape.num_stages)):
        raise ValueError(f"the interleaved schedule needs stage s on rank s % {p} and a multiple of {p} "
                         f"stages (got {shape.num_stages})")
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by the pipeline "
                         f"ranks ({p})")
    total = m * v

    def locate(k: int, forward: bool, rank: int) -> tuple[int, int]:
        in_group = k % (p * v)
        chunk = in_group // p
        if not forward:
            chunk = v - chunk - 1
        mb = (k // (p * v)) * p + in_group % p
        return chunk * p + rank, mb

    out = []
    for rank in range(p):
        if v == 1:
            warmup = min(p - rank - 1, m)
        elif m == p:
            warmup = total  # as Megatron: with one group of micro-batches everything is warm-up
        else:
            warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        tasks = [Task(*locate(k, True, rank), FORWARD) for k in range(warmup)]
        for k in range(total - warmup):
            tasks.append(Task(*locate(k + warmup, True, rank), FORWARD))
            tasks += _backward(shape, *locate(k, False, rank))
        for k in range(total - warmup, total):
            tasks += _backward(shape, *locate(k, False, rank))
        out.append(tasks)
    return out


def zero_bubble(shape: PipelineShape, memory_limit: Optional[int] = None) -> list[list[Task]]:
    """A zero-bubble schedule in the spirit of ZB-H1: backward is split into the input gradient (B),
    which the previous stage waits for, and the weight gradient (W), which nobody waits for.

    Each rank keeps 1F1B's order of forwards and input-gradient backwards, and its weight-gradient
    tasks fill the time it would otherwise wait: ranks are played on a clock with unit task times,
    and whenever the next F or B cannot start yet (its input has not arrived, or `memory_limit`
    micro-batches are already held between their F and their W) a pending W runs instead. The
    default limit, `ranks` on every rank, is the peak 1F1B has on its first rank; later ranks use
    that headroom to defer their Ws, which is what takes the bubble away.
    """
    _require_one_stage_per_rank(shape, "zero-bubble")
    p, m = shape.num_ranks, shape.micro_batches
    limit = memory_limit or p
    plain = PipelineShape(shape.num_stages, shape.num_ranks, m, shape.stage_rank, False)
    main_order = one_f_one_b(plain)  # F and B only, in 1F1B order
    done: dict[tuple, int] = {}
    order: list[list[Task]] = [[] for _ in range(p)]
    nxt = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    in_flight = [0] * p
    remaining = 3 * m * p
    t = 0
    while remaining:
        started = []
        for r in range(p):
            task = None
            if nxt[r] < len(main_order[r]):
                cand = main_order[r][nxt[r]]
                if cand.kind == FORWARD:
                    ready = (r == 0 or done.get((r - 1, cand.micro_batch, FORWARD, True, 0), t + 1) <= t) \
                        and in_flight[r] < limit
                else:
                    ready = r == p - 1 or done.get((r + 1, cand.micro_batch, BACKWARD, True, 0), t + 1) <= t
                if ready:
                    task = cand
                    nxt[r] += 1
            if task is None and pending_w[r]:
                task = Task(r, pending_w[r].pop(0), WEIGHT)
            if task is not None:
                started.append((r, task))
        for r, task in started:
            order[r].append(task)
            done[task.key] = t + 1
            remaining -= 1
            if task.kind == FORWARD:
                in_flight[r] += 1
            elif task.kind == BACKWARD:
                pending_w[r].append(task.micro_batch)
            else:
                in_flight[r] -= 1
        t += 1
        if t > 6 * m * p + 4 * p:
            raise RuntimeError("zero-bubble list scheduling made no progress (a bug)")
    return order


def interlaced(shape: PipelineShape) -> list[list[Task]]:
    """The interlaced pipeline: a shared first stage (a large embedding) and a shared last stage (the
    LM head and its loss) run on every rank at once, the stages between them one per rank. The layer
    stages keep 1F1B's order; the shared steps are slotted in as soon as what they wait for is done,
    all ranks taking them together, and a new micro-batch enters only while fewer than `ranks` are in
    flight (1F1B's memory). Ordered by list scheduling on unit task times."""
    p, m, S = shape.num_ranks, shape.micro_batches, shape.num_stages
    if not (shape.is_shared(0) and shape.is_shared(S - 1) and S == p + 2
            and shape.stage_rank[1:-1] == tuple(range(p))):
        raise ValueError(f"the interlaced schedule needs a shared first and last stage around one stage per rank "
                         f"(stage_rank -1, 0..{p - 1}, -1); got {shape.stage_rank}")
    layers = PipelineShape(p, p, m)
    order_layers = [[Task(t.stage + 1, t.micro_batch, t.kind) for t in tasks] for tasks in one_f_one_b(layers)]
    done: set[tuple] = set()
    nxt = [0] * p
    out: list[list[Task]] = [[] for _ in range(p)]
    entered = finished = 0
    total = p * 2 * m
    shared = [Task(s, mb, k) for mb in range(m) for s, k in ((S - 1, FORWARD), (S - 1, BACKWARD), (0, BACKWARD))]
    while sum(nxt) < total or finished < m:
        ready = [t for t in shared if t.key not in done and all(d in done for d in _deps(t, S))]
        if entered < m and entered - finished < p:
            ready.append(Task(0, entered, FORWARD))
        if ready:
            # drain before filling: finish backwards first, then the loss, then new micro-batches
            task = min(ready, key=lambda t: ({BACKWARD: 0, FORWARD: 1}[t.kind], t.stage != S - 1, t.micro_batch))
            for r in range(p):
                out[r].append(task)
            done.add(task.key)
            if task.stage == 0 and task.kind == FORWARD:
                entered += 1
            if task.stage == 0 and task.kind == BACKWARD:
                finished += 1
            continue
        started = []
        for r in range(p):
            if nxt[r] < len(order_layers[r]):
                t = order_layers[r][nxt[r]]
                if all(d in done for d in _deps(t, S)):
                    started.append((r, t))
        if not started:
            raise RuntimeError("interlaced list scheduling made no progress (a bug)")
        for r, t in started:
            out[r].append(t)
            nxt[r] += 1
            done.add(t.key)
    return out


def _deps(task: Task, num_stages: int) -> list[tuple]:
    s, mb = task.stage, task.micro_batch
    if task.kind == FORWARD:
        return [(s - 1, mb, FORWARD, True, 0)] if s > 0 else []
    deps = [(s, mb, FORWARD, True, 0)]
    if s < num_stages - 1:
        deps.append((s + 1, mb, BACKWARD, True, 0))
    return deps


def _zero_bubble_shape(shape: PipelineShape) -> PipelineShape:
    return shape if shape.split_backward else PipelineShape(shape.num_stages, shape.num_ranks, shape.micro_batches,
                                                            shape.stage_rank, True)


def _zero_bubble_entry(shape: PipelineShape, **options: Any) -> list[list[Task]]:
    return zero_bubble(_zero_bubble_shape(shape), **options)


SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zero-bubble": _zero_bubble_entry,
    "interlaced": interlaced,
}

# Schedules that split backward into B and W whatever the shape asks for.
SPLITS_BACKWARD = frozenset({"zero-bubble"})


def build(schedule: "str | Schedule", shape: PipelineShape, **options: Any) -> list[list[Task]]:
    """Task lists from a schedule name or function, with the shape the schedule needs."""
    if isinstance(schedule, str):
        try:
            fn = SCHEDULES[schedule]
        except KeyError:
            raise ValueError(f"unknown schedule {schedule!r}; built in: {', '.join(SCHEDULES)}, or pass a "
                             "function fn(shape) -> per-rank task lists") from None
    else:
        fn = schedule
    lists = fn(shape, **options)
    if len(lists) != shape.num_ranks:
        raise ValueError(f"schedule returned {len(lists)} task lists for {shape.num_ranks} pipeline ranks")
    return [list(t) for t in lists]
