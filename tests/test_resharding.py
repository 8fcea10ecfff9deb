"""Resharding between every pair of layouts, forward and backward, on real gloo processes.

Forward: the result must be the destination's piece of the same full tensor (for partial-sum
destinations, the pieces must add up to it). Backward: with a loss whose gradient is the dual-layout
piece of a random full gradient G, each source piece's gradient must be the dual-layout piece of G.
"""
from __future__ import annotations

import pytest
import torch

from nnscaler_plugins.layout import Layout
from nnscaler_plugins.lower.resharding import plan

SHAPE = (4, 8)


def all_layouts(n: int, orders: list[tuple[int, ...]]) -> list[Layout]:
    """Every RVD layout of a SHAPE tensor over n devices: each way to write n as replicas x partial
    sums x splits of dim 0 x splits of dim 1, in each given device order, plus every split of dim
    1 also cut in 2 blocks (as fused projections are)."""
    out: list[Layout] = []
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for r in divisors:
        for v in divisors:
            for d0 in divisors:
                if n % (r * v * d0):
                    continue
                d1 = n // (r * v * d0)
                if SHAPE[0] % d0 or SHAPE[1] % d1:
                    continue
                for order in orders:
                    out.append(Layout(SHAPE, order, replicas=r, partial=v, splits=(d0, d1)))
                if d1 > 1 and SHAPE[1] % (2 * d1) == 0:
                    out.append(Layout(SHAPE, orders[0], replicas=r, partial=v, splits=(d0, d1), blocks=(1, 2)))
    return out


def layouts_2() -> list[Layout]:
    return all_layouts(2, [(0, 1), (1, 0)])


def layouts_4() -> list[Layout]:
    return all_layouts(4, [(0, 1, 2, 3), (2, 0, 3, 1)])


def test_layout_lists_are_complete():
    assert len({(l.replicas, l.partial, l.splits) for l in layouts_2()}) == 4
    assert len({(l.replicas, l.partial, l.splits) for l in layouts_4()}) == 10


def _mismatch(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got is None or tuple(got.shape) != tuple(want.shape):
        return f"{what}: shape {None if got is None else tuple(got.shape)}, want {tuple(want.shape)}"
    if not torch.allclose(got, want, atol=1e-5):
        return f"{what}: max abs diff {(got - want).abs().max().item():.3g}"
    return None


def all_pairs(rank: int, world: int, layouts: list[Layout]) -> list[str]:
    """Every (src, dst) pair on this rank; returns what went wrong."""
    import torch.distributed as dist

    from nnscaler_plugins.runtime.process_groups import ProcessGroups

    plans = {(i, j): plan(s, d) for i, s in enumerate(layouts) for j, d in enumerate(layouts)}
    groups = ProcessGroups(set().union(*(p.groups_needed() for p in plans.values())))
    problems = []
    for (i, j), p in plans.items():
        src, dst = layouts[i], layouts[j]
        name = f"rank {rank}: {src} -> {dst} [{p.describe()}]"
        gen = torch.Generator().manual_seed(1000 * i + j)
        full, grad = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
        x = src.slice_full(full, rank).clone().requires_grad_(True)
        out = p.apply(x, rank, groups)
        if dst.partial == 1:
            problems.append(_mismatch(f"{name} forward", out, dst.slice_full(full, rank)))
        else:
            pieces: list = [None] * world
            dist.all_gather_object(pieces, out.detach())
            problems.append(_mismatch(f"{name} forward sum", dst.assemble(dict(enumerate(pieces))), full))
        (out * dst.dual().slice_full(grad, rank)).sum().backward()
        problems.append(_mismatch(f"{name} backward", x.grad, src.dual().slice_full(grad, rank)))
    return [p for p in problems if p]


def test_all_pairs_2(workers2):
    problems = [p for rank in workers2.run(all_pairs, layouts_2(), timeout=120) for p in rank]
    assert not problems, "\n".join(problems)


def test_all_pairs_4(workers4):
    problems = [p for rank in workers4.run(all_pairs, layouts_4(), timeout=120) for p in rank]
    assert not problems, "\n".join(problems)


G4 = (0, 1, 2, 3)


@pytest.mark.parametrize("src,dst,want", [
    (Layout.sharded(SHAPE, G4, 1), Layout.replicated(SHAPE, G4), {"all-gather": 1}),
    (Layout(SHAPE, G4, partial=4), Layout.replicated(SHAPE, G4), {"all-reduce": 1}),
    (Layout(SHAPE, G4, partial=4), Layout.sharded(SHAPE, G4, 0), {"reduce-scatter": 1}),
    (Layout.replicated(SHAPE, G4), Layout.sharded(SHAPE, G4, 1), {}),
    (Layout.replicated(SHAPE, G4), Layout(SHAPE, G4, partial=4), {}),
    (Layout.sharded(SHAPE, G4, 0), Layout.sharded(SHAPE, G4, 1), {"all-to-all": 1}),
    # D4 -> D2 gathers within pairs of neighbouring pieces, which then hold the same half.
    (Layout.sharded(SHAPE, G4, 1), Layout.sharded(SHAPE, (0, 2, 1, 3), 1, num=2), {"all-gather": 1}),
    (Layout.sharded(SHAPE, (0, 2, 1, 3), 1, num=2), Layout.sharded(SHAPE, G4, 1), {}),
    (Layout(SHAPE, G4, splits=(2, 2)), Layout(SHAPE, (0, 2, 1, 3), splits=(2, 2)), {"permute": 1}),
])
def test_classic_cases(src, dst, want):
    p = plan(src, dst)
    assert dict(p.count()) == want, p.describe()
    assert p.steps and len(p.steps) == 1, p.describe()


def test_single_collective_shapes():
    p = plan(Layout.sharded(SHAPE, G4, 1, num=2), Layout.replicated(SHAPE, G4))
    assert p.describe() == "all-gather dim 1 over groups [[0, 1], [2, 3]]"
    assert p.groups_needed() == {(0, 1), (2, 3)}
    assert plan(Layout.replicated(SHAPE, G4), Layout.replicated(SHAPE, G4)).is_identity
    # Unsplit dims' block factors carry no data: nothing to do.
    assert plan(Layout(SHAPE, G4, replicas=4, blocks=(2, 1)), Layout.replicated(SHAPE, G4)).is_identity


def test_layout_round_trips():
    lay = Layout(SHAPE, (3, 1, 2, 0), replicas=2, splits=(1, 2), blocks=(1, 2))
    assert str(lay) == "R2 V1 D(1,2) B(1,2) on [3,1,2,0]"
    assert Layout.from_json(lay.to_json()) == lay
    assert lay.digits(lay.position_of(2)) == (1, 0, (0, 0))
    full = torch.arange(32.0).reshape(SHAPE)
    pieces = {r: lay.slice_full(full, r) for r in lay.group}
    assert torch.equal(pieces[3], full[:, [0, 1, 4, 5]])
    assert torch.equal(lay.assemble(pieces, check_replicas=True), full)
    with pytest.raises(ValueError, match="not divisible"):
        Layout(SHAPE, G4, splits=(1, 4), blocks=(1, 4))


CROSS_SET = [  # (src, dst) on different device sets, as between pipeline stages
    (Layout.sharded(SHAPE, (0, 1), 1), Layout.sharded(SHAPE, (2, 3), 0)),
    (Layout(SHAPE, (0, 1), partial=2), Layout.replicated(SHAPE, (1, 2, 3))),
    (Layout.replicated(SHAPE, (3,)), Layout(SHAPE, (0, 1, 2, 3), partial=2, splits=(1, 2))),
    (Layout(SHAPE, (2, 0, 3, 1), splits=(2, 2)), Layout(SHAPE, (1, 0), partial=2)),
]


def cross_set(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from nnscaler_plugins.runtime.process_groups import ProcessGroups

    plans = [plan(s, d) for s, d in CROSS_SET]
    groups = ProcessGroups(set().union(*(p.groups_needed() for p in plans)))
    problems = []
    for i, p in enumerate(plans):
        src, dst = p.src, p.dst
        full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))
        x = src.slice_full(full, rank) if rank in src.group else None
        out = p.apply(x, rank, groups)
        name = f"rank {rank}: {src} -> {dst} [{p.describe()}]"
        if rank not in dst.group:
            problems.append(None if out is None else f"{name}: returned a tensor off the destination")
            out = None
        elif dst.partial == 1:
            problems.append(_mismatch(name, out, dst.slice_full(full, rank)))
        pieces: list = [None] * world
        dist.all_gather_object(pieces, out)
        if dst.partial > 1 and rank == 0:
            problems.append(_mismatch(f"{name} sum", dst.assemble(dict(enumerate(pieces))), full))
    return [p for p in problems if p]


def test_cross_device_sets(workers4):
    p = plan(*CROSS_SET[0])
    assert [s.kind for s in p.steps] == ["all-gather", "send", "chunk"], p.describe()
    problems = [p for rank in workers4.run(cross_set, timeout=60) for p in rank]
    assert not problems, "\n".join(problems)


class _Offset:
    """Unit-relative device tuples, as ParallelModule addresses a data-parallel replica's groups."""

    def __init__(self, groups, offset: int):
        self.groups, self.offset = groups, offset

    def get(self, ranks):
        return self.groups.get(tuple(self.offset + r for r in ranks))

    def global_rank(self, device: int) -> int:
        return self.offset + device


def groups_and_units(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from nnscaler_plugins.runtime.process_groups import ProcessGroups

    problems = []
    a = ProcessGroups([(1, 0), (2, 3), (0, 1, 2, 3)])
    b = ProcessGroups([(0, 1)])
    if a.get((0, 1)) is not b.get([1, 0]):
        problems.append("a second ProcessGroups made its own group for {0, 1}")
    if a.get((3, 2, 1, 0)) is not dist.group.WORLD:
        problems.append("the full set is not the world group")
    if (a.get((0, 1)) is None) != (rank not in (0, 1)) or a.get((rank,)) is not None:
        problems.append("get: None only off the group and for one rank")
    try:
        a.get((0, 2))
        if rank in (0, 2):
            problems.append("an unknown set did not raise")
    except KeyError:
        pass
    # Two replicas of a two-device unit, each resharding with unit-relative devices.
    unit = _Offset(a, 2 * (rank // 2))
    src, dst = Layout.sharded(SHAPE, (0, 1), 0), Layout.sharded(SHAPE, (1, 0), 0)
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    for d in (dst, Layout.replicated(SHAPE, (0, 1))):
        out = plan(src, d).apply(src.slice_full(full, rank % 2), rank % 2, unit)
        problems.append(_mismatch(f"rank {rank}: {src} -> {d}", out, d.slice_full(full, rank % 2)))
    return [p for p in problems if p]


def test_process_groups_and_unit_offsets(workers4):
    assert dict(plan(Layout.sharded(SHAPE, (0, 1), 0), Layout.sharded(SHAPE, (1, 0), 0)).count()) == {"permute": 1}
    problems = [p for rank in workers4.run(groups_and_units, timeout=60) for p in rank]
    assert not problems, "\n".join(problems)


def op_helpers(rank: int, world: int) -> list[str]:
    """Whole inputs of split pieces: each rank's loss gives a share; the helpers must sum the shares."""
    import torch.distributed as dist

    from nnscaler_plugins.kernels.collectives import (
        allgather_fwd_reducescatter_bwd,
        identity_fwd_allreduce_bwd,
    )

    gen = torch.Generator().manual_seed(3)
    full, weights = torch.randn(SHAPE, generator=gen), torch.randn((world,) + SHAPE, generator=gen)
    x = full.clone().requires_grad_(True)
    (identity_fwd_allreduce_bwd(x, dist.group.WORLD) * weights[rank]).sum().backward()
    problems = [_mismatch(f"rank {rank}: identity_fwd_allreduce_bwd", x.grad, weights.sum(0))]
    lay = Layout.sharded(SHAPE, tuple(range(world)), 1, blocks=2)
    x = lay.slice_full(full, rank).clone().requires_grad_(True)
    y = allgather_fwd_reducescatter_bwd(x, 1, dist.group.WORLD, blocks=2)
    problems.append(_mismatch(f"rank {rank}: gathered", y, full))
    (y * weights[rank]).sum().backward()
    problems.append(_mismatch(f"rank {rank}: reduce-scattered grad", x.grad, lay.slice_full(weights.sum(0), rank)))
    return [p for p in problems if p]


def test_op_helpers(workers2):
    problems = [p for rank in workers2.run(op_helpers, timeout=60) for p in rank]
    assert not problems, "\n".join(problems)
