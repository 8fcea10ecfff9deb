"""Attention over a sequence split across a context-parallel group, exactly as one device computes it.

Each device holds its queries, keys and values for some chunks of the sequence: chunk j of cp
(contiguous split) or chunks j and 2cp-1-j of 2cp (causal load balancing, a mirrored 2-block split,
see `nnscaler_plugins.layout`). Three ways to meet every key:

- ring: key/value blocks travel around the ring, one hop per step, sent while the local block
  computes. Each step gives a partial output and its log-sum-exp; partials merge exactly
  (out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i). Backward runs the ring again:
  every key/value block travels with its gradient accumulators and arrives home after cp hops.
  Causal blocks entirely in the future are skipped, which is what load balancing evens out.
- allgather: keys and values gathered whole (backward: their gradients summed back to owners).
- ulysses (`ulysses_attention`): an all-to-all trades the sequence split for a head split, every
  device runs whole-sequence attention for its heads, and a second all-to-all trades back.

Per-block attention is the math path on CPU. On CUDA the forward blocks use torch's memory-efficient
SDPA kernel, which returns the log-sum-exp (`aten._scaled_dot_product_efficient_attention`); that
path has not been run here (no GPU was available) and backward stays on the math path there too.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.kernels.collectives import all_to_all

MODES = ("ring", "allgather", "ulysses")


def chunk_ids(size: int, index: int, balanced: bool) -> list[int]:
    """Global chunk numbers device `index` of `size` holds, in local order (chunks of S/size, or
    of S/(2 size) when balanced)."""
    return [index, 2 * size - 1 - index] if balanced else [index]


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for 16-bit inputs, else the input's own (fp64 stays fp64)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: query head h reads key/value head h // (heads / kv_heads)."""
    kv = t.shape[-3]
    return t if kv == heads else t.repeat_interleave(heads // kv, dim=-3)


def _reduce_kv(g: torch.Tensor, kv: int) -> torch.Tensor:
    heads = g.shape[-3]
    return g if kv == heads else g.unflatten(-3, (kv, heads // kv)).sum(-3)


def _block_mask(qc: int, kc: int, width: int, device: torch.device) -> Optional[torch.Tensor]:
    """Causal mask between query chunk qc and key chunk kc: None (all visible), a lower triangle,
    or False (nothing visible)."""
    if kc < qc:
        return None
    if kc > qc:
        return False  # type: ignore[return-value]
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output and log-sum-exp (accumulation dtype) for all query heads; `mask` is None
    (all keys visible) or the lower triangle of a diagonal block. Public so that a device check
    (`benchmarks/gpu_wave.py`) can hold the kernel a ring step runs against whole attention."""
    if q.is_cuda:  # untested here: no GPU was available when this was written
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, mask is not None, scale=scale)[:2]
        return out.to(_acc(q)), lse[..., :q.shape[-2]].to(_acc(q))
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(_acc(q))), lse


def merge_blocks(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], o: torch.Tensor,
                 l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' partial attention merged by their log-sum-exps (None: nothing merged yet)."""
    if out is None:
        return o, l
    new = torch.logaddexp(lse, l)
    out = out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
    return out, new


def _block_backward(q, k, v, o, do, lse, mask, scale):
    """Gradients of one block given the merged output's lse (exact: P = exp(S - lse))."""
    qf, kf, vf = q.to(_acc(q)), k.to(_acc(q)), v.to(_acc(q))
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf), dv


class _Pairs:
    """Which (local query chunk, key chunk) blocks attend, for keys held by device `src`."""

    def __init__(self, size: int, me: int, causal: bool, balanced: bool, seq_local: int):
        self.size, self.me, self.causal, self.balanced = size, me, causal, balanced
        self.n = 2 if balanced else 1
        self.width = seq_local // self.n

    def blocks(self, src: int, device: torch.device):
        mine, theirs = chunk_ids(self.size, self.me, self.balanced), chunk_ids(self.size, src, self.balanced)
        for a, qc in enumerate(mine):
            for b, kc in enumerate(theirs):
                mask = _block_mask(qc, kc, self.width, device) if self.causal else None
                if mask is False:
                    continue
                yield a, b, mask

    def cut(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t.narrow(-2, i * self.width, self.width)


def _peers(group: Any) -> tuple[int, int, int, int]:
    size, me = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % size)
    prv = dist.get_global_rank(group, (me - 1) % size)
    return size, me, nxt, prv


def _shift(tensors: list[torch.Tensor], nxt: int, prv: int) -> list:
    """Post sends of `tensors` to the next device and receives from the previous one."""
    tensors = [t.contiguous() for t in tensors]
    recvs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt) for t in tensors] + \
          [dist.P2POp(dist.irecv, r, prv) for r in recvs]
    return recvs, dist.batch_isend_irecv(ops)


def _attend_local(q, kvs, pairs, src_of, scale):
    """Merge the blocks of queries q against the key/value blocks kvs[t] held by device src_of(t)."""
    heads = q.shape[-3]
    outs = [None] * pairs.n
    lses = [None] * pairs.n
    for t, (k, v) in enumerate(kvs):
        ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
        for a, b, mask in pairs.blocks(src_of(t), q.device):
            o, l = block_attention(pairs.cut(q, a), pairs.cut(ke, b), pairs.cut(ve, b), mask, scale)
            outs[a], lses[a] = merge_blocks(outs[a], lses[a], o, l)
    return torch.cat(outs, -2), torch.cat(lses, -1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, balanced, group):
        size, me, nxt, prv = _peers(group)
        pairs = _Pairs(size, me, causal, balanced, q.shape[-2])
        heads = q.shape[-3]
        outs, lses = [None] * pairs.n, [None] * pairs.n
        cur_k, cur_v = k, v
        for step in range(size):
            works = None
            if step + 1 < size:
                (nk, nv), works = _shift([cur_k, cur_v], nxt, prv)
            src = (me - step) % size
            ke, ve = _expand_kv(cur_k, heads), _expand_kv(cur_v, heads)
            for a, b, mask in pairs.blocks(src, q.device):
                o, l = block_attention(pairs.cut(q, a), pairs.cut(ke, b), pairs.cut(ve, b), mask, scale)
                outs[a], lses[a] = merge_blocks(outs[a], lses[a], o, l)
            if works is not None:
                for w in works:
                    w.wait()
                cur_k, cur_v = nk, nv
        out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, balanced, group)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, balanced, group = ctx.args
        size, me, nxt, prv = _peers(group)
        pairs = _Pairs(size, me, causal, balanced, q.shape[-2])
        heads, kv_heads = q.shape[-3], k.shape[-3]
        do = dout.to(_acc(q))
        dq = torch.zeros_like(q, dtype=_acc(q))
        cur_k, cur_v = k, v
        dk = torch.zeros_like(k, dtype=_acc(q))
        dv = torch.zeros_like(v, dtype=_acc(q))
        for step in range(size):
            src = (me - step) % size
            ke, ve = _expand_kv(cur_k, heads), _expand_kv(cur_v, heads)
            dke, dve = torch.zeros_like(ke, dtype=_acc(q)), torch.zeros_like(ve, dtype=_acc(q))
            for a, b, mask in pairs.blocks(src, q.device):
                g_q, g_k, g_v = _block_backward(pairs.cut(q, a), pairs.cut(ke, b), pairs.cut(ve, b),
                                                pairs.cut(out, a), pairs.cut(do, a), pairs.cut(lse.unsqueeze(-1), a)
                                                .squeeze(-1), mask, scale)
                pairs.cut(dq, a).add_(g_q)
                pairs.cut(dke, b).add_(g_k)
                pairs.cut(dve, b).add_(g_v)
            dk = dk + _reduce_kv(dke, kv_heads)
            dv = dv + _reduce_kv(dve, kv_heads)
            # the block and its accumulated gradients go on; after `size` hops they are home
            send = [dk, dv] if step + 1 == size else [cur_k, cur_v, dk, dv]
            recvs, works = _shift(send, nxt, prv)
            for w in works:
                w.wait()
            if step + 1 == size:
                dk, dv = recvs
            else:
                cur_k, cur_v, dk, dv = recvs
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _GatherSumBack(torch.autograd.Function):
    """All-gather along the sequence dim; backward sums every device's gradient to the owner."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


def _allgather_attention(q, k, v, causal, scale, balanced, group):
    size, me = dist.get_world_size(group), dist.get_rank(group)
    pairs = _Pairs(size, me, causal, balanced, q.shape[-2])
    ks, vs = _GatherSumBack.apply(k, group), _GatherSumBack.apply(v, group)
    # autograd through the math blocks: exact, and the gathered keys' gradients flow back summed
    heads = q.shape[-3]
    outs = [None] * pairs.n
    lses = [None] * pairs.n
    for src in range(size):
        ke, ve = _expand_kv(ks[src], heads), _expand_kv(vs[src], heads)
        for a, b, mask in pairs.blocks(src, q.device):
            qa, kb, vb = pairs.cut(q, a).to(_acc(q)), pairs.cut(ke, b).to(_acc(q)), pairs.cut(ve, b).to(_acc(q))
            s = torch.matmul(qa, kb.transpose(-1, -2)) * scale
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            l = torch.logsumexp(s, -1)
            o = torch.matmul(torch.exp(s - l.unsqueeze(-1)), vb)
            outs[a], lses[a] = merge_blocks(outs[a], lses[a], o, l)
    return torch.cat(outs, -2).to(q.dtype)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                               scale: Optional[float] = None, balanced: bool = False, mode: str = "ring",
                               group: Any = None) -> torch.Tensor:
    """Scaled dot-product attention of this device's query chunks against the whole sequence's
    keys, which are split like the queries over `group` (see the module doc for `balanced`)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if group is None or dist.get_world_size(group) == 1:
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=k.shape[-3] != q.shape[-3])
    if mode == "ring":
        return _RingAttention.apply(q, k, v, bool(is_causal), float(scale), bool(balanced), group)
    if mode == "allgather":
        return _allgather_attention(q, k, v, bool(is_causal), float(scale), bool(balanced), group)
    if mode == "ulysses":
        return ulysses_attention(q, k, v, is_causal, scale, balanced, group)
    raise ValueError(f"context-parallel attention mode {mode!r}: use one of {MODES}")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                      scale: Optional[float] = None, balanced: bool = False, group: Any = None) -> torch.Tensor:
    """DeepSpeed-Ulysses: the sequence split becomes a head split for the attention itself. Needs
    the query and key/value head counts divisible by the group size (checked before launch)."""
    n = dist.get_world_size(group)
    if q.shape[-3] % n or k.shape[-3] % n:
        raise ValueError(f"ulysses attention over {n} devices needs head counts divisible by {n}; "
                         f"query heads {q.shape[-3]}, key/value heads {k.shape[-3]}")
    blocks = -2 if balanced else 1
    # [.., H, S/n, D] split on the sequence -> [.., H/n, S, D] split on heads (and back after)
    qh, kh, vh = (all_to_all(t, t.ndim - 2, t.ndim - 3, group, src_blocks=blocks) for t in (q, k, v))
    out = torch.ops.aten.scaled_dot_product_attention.default(
        qh, kh, vh, None, 0.0, bool(is_causal), scale=scale, enable_gqa=kh.shape[-3] != qh.shape[-3])
    return all_to_all(out, out.ndim - 3, out.ndim - 2, group, dst_blocks=blocks)
