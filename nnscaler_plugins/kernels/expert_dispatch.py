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
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.autograd import Function

from nnscaler_plugins.kernels.experts_module import run_experts, run_sorted_experts


class _AllToAllRows(Function):
    """Rows sent in `send` sized chunks to the group's ranks, `recv` sized chunks received."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list, recv: list, group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list, recv: list, group: Any) -> torch.Tensor:
    """Autograd-aware uneven all-to-all of rows (the dispatch and the combine)."""
    return _AllToAllRows.apply(x, send, recv, group)


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


def expert_all_to_all(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *params: torch.Tensor,
                      key: str, names: tuple, first_expert: int, num_experts: int,
                      capacity_factor: Optional[float] = None, group: Any = None) -> torch.Tensor:
    """This device's share of an experts layer: its tokens `x` (T, H) routed by `ids`/`weights`
    (T, K) over `num_experts` experts, of which it holds `params` (experts
    [first_expert, first_expert + E_local)). Returns (T, H) like the whole layer."""
    t, k = ids.shape
    local = params[0].shape[0]
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    if group is None:  # one device holds every expert
        return run_experts(key, tuple(names), x, ids, weights, params)
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
    rows = x[order // k]
    arrived = all_to_all_rows(rows, send, recv, group)  # step 2: dispatch
    local_ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(mine.shape[0]), mine.reshape(-1))
    ones = torch.ones((arrived.shape[0], 1), dtype=weights.dtype, device=x.device)
    y = run_experts(key, tuple(names), arrived, local_ids.unsqueeze(1), ones, params)
    back = all_to_all_rows(y, recv, send, group)  # step 3: combine
    if keep is None:
        out_rows = back[torch.argsort(order)]
    else:
        out_rows = back.new_zeros((t * k,) + tuple(back.shape[1:])).index_add(0, order, back)
    return (out_rows.view(t, k, -1) * weights.unsqueeze(-1).to(out_rows.dtype)).sum(1).to(x.dtype)


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
