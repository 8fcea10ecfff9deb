"""Replaying per-rank task lists as an event timeline, and the dry run every schedule passes first.

Each rank runs its list in order; a task starts when its rank is free and every task it depends on
has finished (plus the transfer time when that task ran on another rank). Sends are asynchronous,
as in the executor, so a rank never waits for its consumers. The same replay serves three purposes:

- `check`: unit task times, before any process starts. A schedule that would deadlock, is missing a
  task, runs one twice or on the wrong rank, or holds more micro-batches than allowed raises
  `PlanError` naming the first task that cannot run and why.
- the simulator: task and transfer times from the cost model.
- the rendered pipeline timeline: the boxes are these events. A step of hundreds of micro-batches
  is drawn with its middle folded (`fold_window`), the folded part summarised by each rank's
  utilization (`Timeline.utilization`), because thousands of hairline boxes read as a grey band.

Dependencies: F(s, mb) needs F(s-1, mb); B(s, mb) needs F(s, mb) and B(s+1, mb); W(s, mb) needs
B(s, mb); a no-grad forward of round r needs the previous stage's no-grad forward of round r.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.schedules import (
    BACKWARD,
    FORWARD,
    SHARED,
    WEIGHT,
    PipelineShape,
    Task,
)

Duration = Callable[[int, Task], float]
Transfer = Callable[[Task, Task], float]


@dataclass(frozen=True)
class Event:
    rank: int
    task: Task
    start: float
    end: float


@dataclass
class Timeline:
    shape: PipelineShape
    events: list[list[Event]]  # per rank, in execution order
    peak_in_flight: list[int]  # per rank: most micro-batches whose activations were held at once

    @property
    def makespan(self) -> float:
        return max((e.end for evs in self.events for e in evs), default=0.0)

    @property
    def busy(self) -> list[float]:
        return [sum(e.end - e.start for e in evs) for evs in self.events]

    @property
    def bubble(self) -> list[float]:
        """Idle time per rank within the step."""
        span = self.makespan
        return [span - b for b in self.busy]

    def bubble_fraction(self) -> float:
        """Idle share of all rank-time in the step."""
        span = self.makespan
        return sum(self.bubble) / (span * len(self.events)) if span else 0.0

    def utilization(self, start: float = 0.0, end: Optional[float] = None) -> list[float]:
        """Busy share of each rank between `start` and `end` (default: the whole step)."""
        end = self.makespan if end is None else end
        if end <= start:
            return [0.0 for _ in self.events]
        return [sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in evs) / (end - start)
                for evs in self.events]


def fold_window(timeline: Timeline, keep: int = 3) -> Optional[tuple[float, float]]:
    """(head_end, tail_start): the stretch of a long step that a picture may fold away, keeping the
    pipeline's fill and the first `keep` micro-batches before it and the last `keep` and its drain
    after it; None when nothing would be folded (fewer than about 2 * keep + 4 micro-batches).

    The head ends when the first stage has finished the backward of micro-batch keep - 1 (by then
    every rank has passed its warm-up); the tail starts when the last stage begins the forward of
    micro-batch m - keep. Schedules where those do not bound a middle (GPipe runs every forward
    first) fold the same proportion of the step instead."""
    shape = timeline.shape
    m = shape.micro_batches
    if m < 2 * keep + 4:
        return None
    end: dict[tuple, float] = {}
    start: dict[tuple, float] = {}
    for evs in timeline.events:
        for e in evs:
            key = (e.task.stage, e.task.micro_batch, e.task.kind)
            end[key] = max(end.get(key, 0.0), e.end)
            start[key] = min(start.get(key, e.start), e.start)
    last = shape.num_stages - 1
    head = end.get((0, keep - 1, BACKWARD))
    tail = start.get((last, m - keep, FORWARD))
    span = timeline.makespan
    if head is None or tail is None or tail - head < 0.1 * span:  # e.g. GPipe: all forwards, then backwards
        head, tail = span * (keep + shape.num_ranks) / (m + shape.num_ranks), \
            span * (m - keep) / (m + shape.num_ranks)
    return (head, tail) if tail - head >= 0.1 * span else None


def dependencies(task: Task, shape: PipelineShape) -> list[tuple]:
    """Keys of the tasks `task` waits for."""
    s, mb = task.stage, task.micro_batch
    if task.kind == FORWARD:
        return [(s - 1, mb, FORWARD, task.grad, task.round)] if s > 0 else []
    if task.kind == BACKWARD:
        deps = [(s, mb, FORWARD, True, 0)]
        if s < shape.num_stages - 1:
            deps.append((s + 1, mb, BACKWARD, True, 0))
        return deps
    return [(s, mb, BACKWARD, True, 0)]


def _name(key: tuple) -> str:
    return str(Task(*key))


def _check_structure(lists: Sequence[Sequence[Task]], shape: PipelineShape) -> None:
    if len(lists) != shape.num_ranks:
        raise PlanError(f"schedule gives {len(lists)} task lists for {shape.num_ranks} pipeline ranks")
    seen: dict[tuple, int] = {}
    on_rank: dict[tuple, int] = {}
    for rank, tasks in enumerate(lists):
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise PlanError(f"rank {rank} task {i} is a {type(task).__name__}, not a Task")
            if not 0 <= task.stage < shape.num_stages:
                raise PlanError(f"task {task} on rank {rank} names stage {task.stage}; the pipeline has stages "
                                f"0..{shape.num_stages - 1}")
            if not 0 <= task.micro_batch < shape.micro_batches:
                raise PlanError(f"task {task} on rank {rank} names micro-batch {task.micro_batch}; the step has "
                                f"micro-batches 0..{shape.micro_batches - 1}")
            owner = shape.stage_rank[task.stage]
            if owner != rank and owner != SHARED:
                raise PlanError(f"task {task} is on rank {rank}, but stage {task.stage} runs on rank {owner}")
            if task.kind == WEIGHT and not shape.split_backward:
                raise PlanError(f"task {task} on rank {rank}: weight-gradient tasks need a schedule that splits "
                                "backward (split_backward=True); this one computes weight gradients in B")
            if (rank, task.key) in on_rank:
                raise PlanError(f"task {task} appears twice (rank {rank} positions {on_rank[rank, task.key]} and {i})")
            on_rank[rank, task.key] = i
            seen[task.key] = i
    kinds = (FORWARD, BACKWARD, WEIGHT) if shape.split_backward else (FORWARD, BACKWARD)
    for s in range(shape.num_stages):
        for mb in range(shape.micro_batches):
            for kind in kinds:
                key = (s, mb, kind, True, 0)
                if key not in seen:
                    what = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight-gradient"}[kind]
                    due = "every rank" if shape.is_shared(s) else f"rank {shape.stage_rank[s]}"
                    raise PlanError(f"the schedule never runs the {what} of stage {s} micro-batch {mb} "
                                    f"(task {_name(key)}, due on {due})")
    for key in seen:
        if shape.is_shared(key[0]):
            missing = [r for r in range(shape.num_ranks) if (r, key) not in on_rank]
            if missing:
                raise PlanError(f"task {Task(*key)} of the shared stage {key[0]} must be in every rank's list; "
                                f"rank(s) {missing} lack it")
    for key in seen:
        task = Task(*key)
        for dep in dependencies(task, shape):
            if dep not in seen:
                raise PlanError(f"task {task} needs {_name(dep)}, which no rank runs: its receive would never be "
                                "matched by a send")


def replay(lists: Sequence[Sequence[Task]], shape: PipelineShape, duration: Optional[Duration] = None,
           transfer: Optional[Transfer] = None) -> Timeline:
    """Run the task lists on a clock; raises PlanError if they are malformed or deadlock."""
    _check_structure(lists, shape)
    duration = duration or (lambda rank, task: 1.0)
    transfer = transfer or (lambda src, dst: 0.0)
    p = shape.num_ranks
    pos = [0] * p
    free = [0.0] * p
    end: dict[tuple, float] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    in_flight = [0] * p
    peak = [0] * p
    release = WEIGHT if shape.split_backward else BACKWARD
    remaining = sum(len(t) for t in lists)
    def run(ranks: list[int], task: Task, deps: list[tuple]) -> None:
        nonlocal remaining
        start = max(free[r] for r in ranks)
        for d in deps:
            t = end[d]
            if shape.stage_rank[d[0]] not in ranks:
                t += transfer(Task(*d), task)
            start = max(start, t)
        finish = start + max(duration(r, task) for r in ranks)
        end[task.key] = finish
        for r in ranks:
            free[r] = finish
            events[r].append(Event(r, task, start, finish))
            if task.kind == FORWARD and task.grad:
                in_flight[r] += 1
                peak[r] = max(peak[r], in_flight[r])
            elif task.kind == release:
                in_flight[r] -= 1
            pos[r] += 1
            remaining -= 1

    everyone = list(range(p))
    while remaining:
        progress = False
        for r in range(p):
            tasks = lists[r]
            while pos[r] < len(tasks):
                task = tasks[pos[r]]
                deps = dependencies(task, shape)
                if any(d not in end for d in deps):
                    break
                if shape.is_shared(task.stage):
                    # every rank takes it together, once all of them have reached it
                    if any(pos[q] >= len(lists[q]) or lists[q][pos[q]] != task for q in everyone):
                        break
                    run(everyone, task, deps)
                else:
                    run([r], task, deps)
                progress = True
        if not progress:
            raise PlanError(_deadlock_message(lists, shape, pos, end))
    return Timeline(shape, events, peak)


def _deadlock_message(lists: Sequence[Sequence[Task]], shape: PipelineShape, pos: list[int],
                      end: dict[tuple, float]) -> str:
    where = {t.key: (r, i) for r, tasks in enumerate(lists) for i, t in enumerate(tasks)}
    stuck = [r for r in range(shape.num_ranks) if pos[r] < len(lists[r])]

    def blocks_itself(r: int) -> bool:
        task = lists[r][pos[r]]
        return any(d not in end and where[d][0] == r for d in dependencies(task, shape))

    stuck.sort(key=lambda r: (not blocks_itself(r), r))  # the root cause first
    lines = []
    for r in stuck:
        task = lists[r][pos[r]]
        missing = [d for d in dependencies(task, shape) if d not in end]
        parts = []
        for d in missing:
            dr, di = where[d]
            blocker = lists[dr][pos[dr]]
            parts.append(f"{_name(d)} (rank {dr}, position {di}, behind its blocked task {blocker})"
                         if di > pos[dr] else f"{_name(d)} (rank {dr})")
        if not missing and shape.is_shared(task.stage):
            others = [f"rank {q} at {lists[q][pos[q]] if pos[q] < len(lists[q]) else 'its end'}"
                      for q in range(shape.num_ranks) if pos[q] >= len(lists[q]) or lists[q][pos[q]] != task]
            parts.append(f"every rank to reach it together ({', '.join(others)})")
        lines.append(f"rank {r} cannot run {task} (position {pos[r]}): it waits for {', '.join(parts)}")
    first = lines[0]
    rest = "".join(f"\n  {l}" for l in lines[1:])
    return (f"the pipeline schedule deadlocks: {first}{rest}\nReorder the tasks so that every task comes after "
            "the tasks it waits for on its own rank, or use a built-in schedule.")


def check(lists: Sequence[Sequence[Task]], shape: PipelineShape,
          memory_limit: Union[None, int, Sequence[int]] = None) -> Timeline:
    """The dry run: replay with unit times; enforce a limit on micro-batches held per rank."""
    timeline = replay(lists, shape)
    if memory_limit is not None:
        limits = [memory_limit] * shape.num_ranks if isinstance(memory_limit, int) else list(memory_limit)
        for r, (peak, limit) in enumerate(zip(timeline.peak_in_flight, limits)):
            if peak > limit:
                over = _first_over(timeline, shape, r, limit)
                raise PlanError(f"rank {r} holds the activations of {peak} micro-batches at once (first over the "
                                f"limit of {limit} at task {over}); use a schedule that runs backwards earlier "
                                "(1F1B) or fewer micro-batches in flight")
    return timeline


def _first_over(timeline: Timeline, shape: PipelineShape, rank: int, limit: int) -> Task:
    release = WEIGHT if shape.split_backward else BACKWARD
    held = 0
    for e in timeline.events[rank]:
        if e.task.kind == FORWARD and e.task.grad:
            held += 1
            if held > limit:
                return e.task
        elif e.task.kind == release:
            held -= 1
    raise AssertionError("peak over the limit but no task found")
