"""Piece functions that communicate (kernels/piece_functions.py): pieces of an op that must talk to
each other, checked on real gloo workers.

The single-process property test in test_rules.py cannot run these splits (they need a process
group), so here each rank runs its piece of the vocabulary-parallel embedding and cross-entropy and
of the batch-split mean cross-entropy, and the pieces are compared with the whole op, forward and
backward, for every reduction and with ignored targets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nnscaler_plugins.layout import chunk_dim

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got is None or got.shape != want.shape:
        return f"{what}: shape {None if got is None else tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"{what}: max abs diff {(got - want).abs().max().item():.3g}"
    return None


def vocab_parallel_ce(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from nnscaler_plugins.kernels.piece_functions import vocab_parallel_cross_entropy

    problems = []
    gen = torch.Generator().manual_seed(0)
    for shape in ((6, 8 * world), (2, 8 * world, 3)):  # [N, C] and [N, C, d1] (class dim 1)
        logits = torch.randn(shape, generator=gen)
        target_shape = (shape[0],) + shape[2:]
        target = torch.randint(0, shape[1], target_shape, generator=gen)
        target.view(-1)[0] = -100  # an ignored position
        for reduction, name in REDUCTIONS.items():
            whole = logits.clone().requires_grad_(True)
            want = F.cross_entropy(whole, target, reduction=name)
            upstream = torch.randn(want.shape, generator=gen)
            (want * upstream).sum().backward()
            piece = chunk_dim(logits, 1, world, rank).clone().requires_grad_(True)
            start = rank * piece.shape[1]
            got = vocab_parallel_cross_entropy(piece, target, start, reduction, -100, group=dist.group.WORLD)
            (got * upstream).sum().backward()
            what = f"rank {rank} {shape} reduction={name}"
            problems.append(_close(f"{what} forward", got.detach(), want.detach()))
            problems.append(_close(f"{what} grad", piece.grad, chunk_dim(whole.grad, 1, world, rank)))
    return [p for p in problems if p]


def vocab_parallel_embedding(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from nnscaler_plugins.kernels.piece_functions import (
        vocab_parallel_embedding as lookup,
    )

    gen = torch.Generator().manual_seed(1)
    table = torch.randn(4 * world, 5, generator=gen)
    ids = torch.randint(0, table.shape[0], (3, 7), generator=gen)
    whole = table.clone().requires_grad_(True)
    want = F.embedding(ids, whole, padding_idx=1)
    upstream = torch.randn(want.shape, generator=gen)
    (want * upstream).sum().backward()
    piece = chunk_dim(table, 0, world, rank).clone().requires_grad_(True)
    out = lookup(piece, ids, rank * piece.shape[0], padding_idx=1)
    (out * upstream).sum().backward()
    summed = out.detach().clone()
    dist.all_reduce(summed)  # the pieces are partial sums of the whole lookup
    problems = [_close(f"rank {rank} embedding forward", summed, want.detach()),
                _close(f"rank {rank} embedding grad", piece.grad, chunk_dim(whole.grad, 0, world, rank))]
    return [p for p in problems if p]


def batch_split_mean_ce(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from nnscaler_plugins.kernels.piece_functions import batch_split_mean_cross_entropy

    gen = torch.Generator().manual_seed(2)
    problems = []
    for weighted in (False, True):
        logits = torch.randn(4 * world, 6, generator=gen)
        target = torch.randint(0, 6, (4 * world,), generator=gen)
        target[:2] = -100  # ignored targets, all in the first piece: the counts differ per piece
        weight = torch.rand(6, generator=gen) + 0.5 if weighted else None
        whole = logits.clone().requires_grad_(True)
        want = F.cross_entropy(whole, target, weight=weight)
        want.backward()
        piece = chunk_dim(logits, 0, world, rank).clone().requires_grad_(True)
        local_target = chunk_dim(target, 0, world, rank)
        got = batch_split_mean_cross_entropy(piece, local_target, weight, group=dist.group.WORLD)
        got.backward()
        summed = got.detach().clone()
        dist.all_reduce(summed)
        what = f"rank {rank} weighted={weighted}"
        problems.append(_close(f"{what} forward", summed, want.detach()))
        problems.append(_close(f"{what} grad", piece.grad, chunk_dim(whole.grad, 0, world, rank)))
    return [p for p in problems if p]


def test_vocab_parallel_cross_entropy(workers2, workers4):
    for workers in (workers2, workers4):
        problems = [p for rank in workers.run(vocab_parallel_ce, timeout=60) for p in rank]
        assert not problems, "\n".join(problems)


def test_vocab_parallel_embedding(workers2, workers4):
    for workers in (workers2, workers4):
        problems = [p for rank in workers.run(vocab_parallel_embedding, timeout=60) for p in rank]
        assert not problems, "\n".join(problems)


def test_batch_split_mean_cross_entropy(workers2):
    problems = [p for rank in workers2.run(batch_split_mean_ce, timeout=60) for p in rank]
    assert not problems, "\n".join(problems)
