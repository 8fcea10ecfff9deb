"""Expert parallelism's kernel: tokens travel to the devices holding their experts and back.

A piece of an experts op split along experts (see `rules/experts_op.py`) holds a contiguous share
of the experts and its own tokens. Which tokens go where is data, so the exchange is sized at run
time, in three steps over the expert-parallel group:

1. counts: every device tells the group how many of its (token, choice) rows go to each expert
   (one small all-gather, which also says which share of the experts each group rank holds);
2. dispatch: the rows go to the device holding their expert (`all_to_all_single` with uneven
   splits), are computed by the module's own forward on the local expert weights;
3. combine: the results come back by the reverse all-to-all and are summed per token with the
   router weights, as the module itself would.

Backward is the same exchanges in reverse (the gradient of an all-to-all is the all-to-all with
the splits swapped), so gradients are exact: each expert's weights get the gradient of exactly
the rows routed to it from every device of the group.

No row is dropped unless `capacity_factor` is given: then each device sends at most
`ceil(capacity_factor * rows / experts)` rows to each expert (its rows in token order) and the
others contribute zero, as Megatron's capacity does. That changes the numbers against the
model run in one process; it is opt-in for that reason.

Where the model has compute that needs neither the experts' inputs nor their output (a shared
expert), the lowering runs the layer in three calls with that compute between them
(lower/expert_overlap.py): `expert_dispatch_start` (counts, then the dispatch started),
`expert_dispatch_compute` (the dispatch waited for, the experts run, the combine started) and
`expert_dispatch_finish` (the combine waited for and summed per token), so each all-to-all is in
flight beside the shared expert's matmuls. In backward, each all-to-all's reverse exchange starts
as soon as its gradient is whole (`early_backward`), so it is in flight while autograd runs the
shared expert's nodes, which were made after the exchange started and so come first.
`expert_all_to_all` is the three in a row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.autograd import Function

from nnscaler_plugins.kernels.experts_module import run_experts, run_sorted_experts


class _Early:
    """The reverse exchange of one all-to-all, started in backward before its node runs."""

    __slots__ = ("work", "out", "sent")

    def __init__(self) -> None:
        self.work = self.out = self.sent = None


class _AllToAllRows(Function):
    """Rows sent in `send` sized chunks to the group's ranks, `recv` sized chunks received. With a
    `pending` list the forward only starts the exchange and appends its work there: whoever reads
    the result waits for it first. Backward runs the exchange reversed, or waits for it where
    `early_backward` started it already."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list, recv: list, group: Any, pending: Optional[list] = None,
                early: Optional[_Early] = None) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.early = send, recv, group, early
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        sent = x.contiguous()
        work = dist.all_to_all_single(out, sent, output_split_sizes=recv, input_split_sizes=send, group=group,
                                      async_op=pending is not None)
        if pending is not None:
            pending.append((work, sent))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        early = ctx.early
        if early is not None and early.work is not None:
            early.work.wait()
            out, early.work, early.out, early.sent = early.out, None, None, None
            return out, None, None, None, None, None
        return _reverse(grad, ctx.send, ctx.recv, ctx.group, False)[0], None, None, None, None, None


def _reverse(grad: torch.Tensor, send: list, recv: list, group: Any, async_op: bool) -> tuple:
    out = grad.new_empty((sum(send),) + tuple(grad.shape[1:]))
    sent = grad.contiguous()
    work = dist.all_to_all_single(out, sent, output_split_sizes=send, input_split_sizes=recv, group=group,
                                  async_op=async_op)
    return out, work, sent


class _StartEarly(Function):
    """Identity forward; backward starts the reverse exchange of the all-to-all that made `x` (which
    then only waits for it), so it is in flight while autograd runs the nodes made between the two
    (the shared expert's, placed there by the lowering)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list, recv: list, group: Any, early: _Early) -> torch.Tensor:
        ctx.args = (send, recv, group, early)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        send, recv, group, early = ctx.args
        early.out, early.work, early.sent = _reverse(grad, send, recv, group, True)
        return grad, None, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list, recv: list, group: Any, pending: Optional[list] = None,
                    early: Optional[_Early] = None) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows (the dispatch and the combine); with `pending`, only
    started (its work appended there, to be waited for before the result is read); with `early`,
    its backward waits for the reverse exchange `early_backward` started."""
    return _AllToAllRows.apply(x, send, recv, group, pending, early)


def early_backward(x: torch.Tensor, send: list, recv: list, group: Any, early: _Early) -> torch.Tensor:
    """`x` (an all-to-all's result) for its readers, its gradient's reverse exchange started as soon
    as backward has it."""
    return _StartEarly.apply(x, send, recv, group, early)


def exchange_counts(counts: torch.Tensor, piece: int, group: Any) -> torch.Tensor:
    """Every group rank's [piece index, rows per expert...] as a (group size, 1 + experts) tensor."""
    mine = torch.cat([counts.new_tensor([piece]), counts])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts)


def within_capacity(sorted_ids: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which rows fit in their expert's capacity: the first `capacity` of each run of equal ids
    (rows are grouped by expert, in token order inside a group)."""
    n = sorted_ids.numel()
    index = torch.arange(n, device=sorted_ids.device)
    starts = torch.ones(n, dtype=torch.bool, device=sorted_ids.device)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    run_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    return index - run_start < capacity


@dataclass
class ExpertExchange:
    """One experts layer between its three calls: the rows in flight and what puts them back."""

    t: int
    k: int
    dtype: torch.dtype
    weights: torch.Tensor
    order: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    send: Optional[list] = None
    recv: Optional[list] = None
    group: Any = None
    rows: Optional[torch.Tensor] = None  # the dispatched rows (arrived once `pending` is done), then the combined
    pending: Optional[list] = None
    run: Optional[tuple] = None  # (key, names, local ids, params) of the local experts
    done: Optional[torch.Tensor] = None  # the layer's output when one device holds every expert
    early: Optional[_Early] = None  # the backward exchange of the all-to-all in flight now

    def wait(self) -> None:
        for work, _ in self.pending or ():
            work.wait()
        self.pending = []


def expert_dispatch_start(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *params: torch.Tensor,
                          key: str, names: tuple, first_expert: int, num_experts: int,
                          capacity_factor: Optional[float] = None, group: Any = None) -> ExpertExchange:
    """The counts exchanged and the dispatch all-to-all started (see `expert_all_to_all`)."""
    t, k = ids.shape
    local = params[0].shape[0]
    flat = ids.reshape(-1)
    if group is None:  # one device holds every expert
        return ExpertExchange(t, k, x.dtype, weights, done=run_experts(key, tuple(names), x, ids, weights, params))
    counts = torch.bincount(flat, minlength=num_experts)
    capacity = None if capacity_factor is None else math.ceil(capacity_factor * flat.numel() / num_experts)
    sent_counts = counts if capacity is None else counts.clamp(max=capacity)
    table = exchange_counts(sent_counts, first_expert // local, group)  # step 1: counts (and who holds what)
    rank_of_piece = torch.empty_like(table[:, 0])
    rank_of_piece[table[:, 0]] = torch.arange(table.shape[0], dtype=table.dtype)
    dest = rank_of_piece[flat // local]
    order = torch.argsort(dest * num_experts + flat, stable=True)  # rows by destination, then expert
    keep: Optional[torch.Tensor] = None
    if capacity is not None:
        keep = within_capacity(flat[order], capacity)
        order = order[keep]
    per_rank = sent_counts.view(-1, local).sum(1)  # by piece
    send = [int(per_rank[int(p)]) for p in table[:, 0].tolist()]
    mine = table[:, 1 + first_expert:1 + first_expert + local]  # (ranks, local experts) rows coming to me
    recv = [int(c) for c in mine.sum(1).tolist()]
    pending: list = []
    early = _Early()
    arrived = all_to_all_rows(x[order // k], send, recv, group, pending, early)  # step 2: dispatch, started
    local_ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(mine.shape[0]), mine.reshape(-1))
    return ExpertExchange(t, k, x.dtype, weights, order, keep, send, recv, group, arrived, pending,
                          (key, tuple(names), local_ids, params), early=early)


def expert_dispatch_compute(ex: ExpertExchange) -> ExpertExchange:
    """The dispatched rows waited for, the local experts run on them, the combine all-to-all started."""
    if ex.done is not None:
        return ex
    ex.wait()
    key, names, local_ids, params = ex.run
    # backward: the dispatch's reverse exchange starts once the experts' backward is done, beside
    # the nodes made since the dispatch started
    arrived = early_backward(ex.rows, ex.send, ex.recv, ex.group, ex.early)
    ones = torch.ones((arrived.shape[0], 1), dtype=ex.weights.dtype, device=arrived.device)
    y = run_experts(key, names, arrived, local_ids.unsqueeze(1), ones, params)
    ex.run = None
    ex.early = _Early()
    ex.rows = all_to_all_rows(y, ex.recv, ex.send, ex.group, ex.pending, ex.early)  # step 3: combine, started
    return ex


def expert_dispatch_finish(ex: ExpertExchange) -> torch.Tensor:
    """The combined rows waited for and summed per token with the router weights."""
    if ex.done is not None:
        return ex.done
    ex.wait()
    back = early_backward(ex.rows, ex.recv, ex.send, ex.group, ex.early)  # the combine's reverse, started early
    if ex.keep is None:
        out_rows = back[torch.argsort(ex.order)]
    else:
        out_rows = back.new_zeros((ex.t * ex.k,) + tuple(back.shape[1:])).index_add(0, ex.order, back)
    return (out_rows.view(ex.t, ex.k, -1) * ex.weights.unsqueeze(-1).to(out_rows.dtype)).sum(1).to(ex.dtype)


def expert_all_to_all(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *params: torch.Tensor,
                      key: str, names: tuple, first_expert: int, num_experts: int,
                      capacity_factor: Optional[float] = None, group: Any = None) -> torch.Tensor:
    """This device's share of an experts layer: its tokens `x` (T, H) routed by `ids`/`weights`
    (T, K) over `num_experts` experts, of which it holds `params` (experts
    [first_expert, first_expert + E_local)). Returns (T, H) like the whole layer."""
    ex = expert_dispatch_start(x, ids, weights, *params, key=key, names=names, first_expert=first_expert,
                               num_experts=num_experts, capacity_factor=capacity_factor, group=group)
    return expert_dispatch_finish(expert_dispatch_compute(ex))


def sorted_expert_all_to_all(x: torch.Tensor, counts: torch.Tensor, probs: Optional[torch.Tensor],
                             *params: torch.Tensor, key: str, names: tuple, first_row: int, first_expert: int,
                             num_experts: int, group: Any = None) -> torch.Tensor:
    """This device's share of a sorted-experts layer (`SortedExpertsCall`): its piece `x` of the rows
    sorted by expert -- rows [first_row, first_row + len(x)) of all of them --, the whole `counts`
    (rows per expert, so every piece knows which expert each of its rows belongs to), a probability
    per row or None, and its share of the experts' weights (experts [first_expert, first_expert +
    E_local)). Returns its rows' outputs as the whole module would give them; rows past the counts'
    total (padding) give zeros.

    The same three steps as `expert_all_to_all`: counts over the group, rows to the devices holding
    their experts (already grouped by expert, so by destination), the module's own forward on the
    rows that arrived, sorted by local expert, and the outputs back."""
    local = params[0].shape[0]
    n = x.shape[0]
    bounds = torch.cumsum(counts.to(torch.long), 0)
    rows = torch.arange(first_row, first_row + n, device=x.device)
    ids = torch.searchsorted(bounds, rows, right=True)  # each row's expert; num_experts for padding rows
    valid = ids < num_experts
    mine_counts = torch.bincount(ids[valid], minlength=num_experts)
    if group is None:  # one device holds every expert
        return run_sorted_experts(key, tuple(names), x, counts, probs, params)
    table = exchange_counts(mine_counts, first_expert // local, group)  # step 1: counts (and who holds what)
    rank_of_piece = torch.empty_like(table[:, 0])
    rank_of_piece[table[:, 0]] = torch.arange(table.shape[0], dtype=table.dtype)
    kept = torch.nonzero(valid).reshape(-1)
    dest = rank_of_piece[ids[kept] // local]
    order = kept[torch.argsort(dest, stable=True)]  # by destination rank, by expert inside each
    per_piece = mine_counts.view(-1, local).sum(1)
    send = [int(per_piece[int(p)]) for p in table[:, 0].tolist()]
    arriving = table[:, 1 + first_expert:1 + first_expert + local]  # (ranks, local experts) rows coming here
    recv = [int(c) for c in arriving.sum(1).tolist()]
    got = all_to_all_rows(x[order], send, recv, group)  # step 2: dispatch
    got_probs = None if probs is None else all_to_all_rows(probs.reshape(n, -1)[order], send, recv, group)
    local_ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(arriving.shape[0]),
                                        arriving.reshape(-1))
    by_expert = torch.argsort(local_ids, stable=True)
    y = run_sorted_experts(key, tuple(names), got[by_expert], arriving.sum(0).to(counts.dtype),
                           None if got_probs is None else got_probs[by_expert].reshape((-1,) + tuple(probs.shape[1:])),
                           params)
    back = all_to_all_rows(y[torch.argsort(by_expert)], recv, send, group)  # step 3: combine
    out = back.new_zeros((n,) + tuple(back.shape[1:]))
    return out.index_copy(0, order, back).to(x.dtype)
