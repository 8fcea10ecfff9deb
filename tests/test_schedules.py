"""Schedules as data: the built-ins order every task correctly, hold the memory their papers say,
and broken schedules are refused by the dry run with the first task that cannot run."""
from __future__ import annotations

import pytest

from nnscaler_plugins import PlanError
from nnscaler_plugins.plan.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    PipelineShape,
    Task,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble,
)
from nnscaler_plugins.plan.timeline import check, replay

SHAPES = [(2, 4), (4, 4), (4, 8), (3, 7), (8, 16)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_holds_every_micro_batch(p, m):
    shape = PipelineShape(p, p, m)
    tl = check(gpipe(shape), shape)
    assert tl.peak_in_flight == [m] * p
    assert tl.makespan == 2 * (m + p - 1)  # (m + p - 1)(t_f + t_b) with unit times


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_holds_at_most_ranks_minus_rank(p, m):
    shape = PipelineShape(p, p, m)
    tl = check(one_f_one_b(shape), shape)
    assert tl.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert tl.makespan == 2 * (m + p - 1)  # same bubble as GPipe, (p - 1) / (m + p - 1)
    assert tl.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 2, 2), (4, 2, 4)])
def test_interleaved_shrinks_the_bubble_by_the_chunks(p, v, m):
    shape = PipelineShape(p * v, p, m)
    tl = check(interleaved_1f1b(shape), shape, memory_limit=None)
    # Each task is a chunk of 1/v of the model: unit times per chunk, so the ideal is 2 m v.
    ideal = 2 * m * v
    assert tl.makespan == ideal + 2 * (p - 1)  # bubble (p - 1) / (v m) of the ideal
    flat = PipelineShape(p, p, m)
    assert tl.makespan / v < check(one_f_one_b(flat), flat).makespan


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_beats_1f1b_at_the_same_memory(p, m):
    split = PipelineShape(p, p, m, split_backward=True)
    zb = check(zero_bubble(split), split)
    ref = check(one_f_one_b(split), split)  # 1F1B with B and W back to back
    assert zb.makespan < ref.makespan
    assert max(zb.peak_in_flight) == max(ref.peak_in_flight)  # the same peak memory per device
    # ZB-H1's bubble (p - 1)(t_F + t_B - t_W): with unit times a third of unsplit 1F1B's (p - 1)(t_F + t_B + t_W).
    assert zb.makespan == 3 * m + (p - 1)


def test_build_by_name_and_unknown_name():
    shape = PipelineShape(2, 2, 4)
    assert build("1f1b", shape) == one_f_one_b(shape)
    zb = build("zero-bubble", shape)
    assert any(t.kind == WEIGHT for t in zb[0])
    with pytest.raises(ValueError, match="unknown schedule"):
        build("no-such", shape)


def test_user_schedule_with_no_grad_recycling_passes():
    """AlphaFold-style: two no-grad passes of the whole model, then one training pass per micro-batch."""
    def recycle(shape, passes=2):
        out = []
        for r in range(shape.num_ranks):
            tasks = [Task(r, mb, FORWARD, grad=False, round=k) for k in range(passes) for mb in range(shape.micro_batches)]
            tasks += one_f_one_b(shape)[r]
            out.append(tasks)
        return out

    shape = PipelineShape(3, 3, 2)
    tl = check(build(recycle, shape), shape)
    assert tl.peak_in_flight == [2, 2, 1]  # no-grad passes hold nothing
    assert sum(len(e) for e in tl.events) == 3 * (2 * 2 + 2 * 2)


def test_replay_with_durations_and_transfers():
    shape = PipelineShape(2, 2, 1)
    tl = replay(one_f_one_b(shape), shape, duration=lambda r, t: 2.0 if t.kind == BACKWARD else 1.0,
                transfer=lambda a, b: 0.5)
    # F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7]
    assert tl.makespan == 7.0
    assert [(e.start, e.end) for e in tl.events[0]] == [(0.0, 1.0), (5.0, 7.0)]


# -- broken schedules ------------------------------------------------------------------------------------------
def _1f1b(p=2, m=2):
    shape = PipelineShape(p, p, m)
    return one_f_one_b(shape), shape


def test_deadlock_names_the_first_blocked_task():
    lists, shape = _1f1b()
    # Rank 0 runs the backward of micro-batch 0 before the forward that rank 1 waits for.
    lists[0] = [Task(0, 0, FORWARD), Task(0, 0, BACKWARD), Task(0, 1, FORWARD), Task(0, 1, BACKWARD)]
    lists[1] = [Task(1, 1, FORWARD), Task(1, 1, BACKWARD), Task(1, 0, FORWARD), Task(1, 0, BACKWARD)]
    with pytest.raises(PlanError, match=r"deadlocks: rank 0 cannot run B0.0 .*waits for B1.0") as e:
        check(lists, shape)
    assert "rank 1 cannot run F1.1" in str(e.value)


def test_backward_before_its_forward_on_the_same_rank():
    lists, shape = _1f1b()
    lists[1] = [Task(1, 0, BACKWARD), Task(1, 0, FORWARD), Task(1, 1, FORWARD), Task(1, 1, BACKWARD)]
    with pytest.raises(PlanError, match="rank 1 cannot run B1.0 .*waits for F1.0"):
        check(lists, shape)


def test_missing_duplicate_and_misplaced_tasks():
    lists, shape = _1f1b()
    lists[1] = lists[1][:-1]
    with pytest.raises(PlanError, match="never runs the backward of stage 1 micro-batch 1"):
        check(lists, shape)
    lists, shape = _1f1b()
    lists[0].append(Task(0, 0, FORWARD))
    with pytest.raises(PlanError, match="F0.0 appears twice"):
        check(lists, shape)
    lists, shape = _1f1b()
    lists[0].insert(0, lists[1].pop(0))
    with pytest.raises(PlanError, match="is on rank 0, but stage 1 runs on rank 1"):
        check(lists, shape)
    lists, shape = _1f1b()
    lists[0].append(Task(0, 5, FORWARD))
    with pytest.raises(PlanError, match="micro-batch 5"):
        check(lists, shape)


def test_unmatched_receive_and_weight_tasks_without_split():
    lists, shape = _1f1b()
    lists[1].insert(0, Task(1, 0, FORWARD, grad=False))  # its sender, F~0.0, is never run
    with pytest.raises(PlanError, match="needs F0.0~, which no rank runs"):
        check(lists, shape)
    lists, shape = _1f1b()
    lists[0].append(Task(0, 0, WEIGHT))
    with pytest.raises(PlanError, match="split_backward"):
        check(lists, shape)


def test_memory_limit():
    shape = PipelineShape(4, 4, 8)
    with pytest.raises(PlanError, match="rank 0 holds the activations of 8 micro-batches .*limit of 4"):
        check(gpipe(shape), shape, memory_limit=4)
    check(one_f_one_b(shape), shape, memory_limit=4)


def _interlaced_shape(p=2, m=4):
    return PipelineShape(p + 2, p, m, stage_rank=tuple([-1] + list(range(p)) + [-1]))


def test_interlaced_shared_stages_run_together():
    from nnscaler_plugins.plan.schedules import interlaced

    shape = _interlaced_shape()
    tl = check(interlaced(shape), shape)
    for task in (Task(0, 1, FORWARD), Task(3, 2, BACKWARD)):
        starts = {e.start for evs in tl.events for e in evs if e.task == task}
        assert len(starts) == 1  # every rank runs a shared task at the same time
    lists = interlaced(shape)
    lists[1] = [t for t in lists[1] if t != Task(3, 0, FORWARD)]
    with pytest.raises(PlanError, match=r"F3.0 of the shared stage 3 must be in every rank's list; rank\(s\) \[1\]"):
        check(lists, shape)
    lists = interlaced(shape)
    i, j = lists[1].index(Task(0, 0, FORWARD)), lists[1].index(Task(0, 1, FORWARD))
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]  # the ranks disagree on the order of shared steps
    with pytest.raises(PlanError, match="every rank to reach it together"):
        check(lists, shape)
