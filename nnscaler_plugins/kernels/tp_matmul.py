"""Tensor-parallel matmuls with their collectives pipelined in chunks (async TP, tp-comm-overlap).

A column-parallel matmul reads an input all-gathered over the tensor-parallel group (sequence
parallelism) and a row-parallel one leaves partial sums that are all-reduced or reduce-scattered.
Run one after the other, the collective waits for the whole matmul, or the matmul for the whole
collective. Here they run as PyTorch's async TP and Megatron-Core's tp-comm-overlap do: the
rows are cut into `chunks` pieces and the collective of one piece is in flight while the matmul
computes the previous (input side) or the next (output side) piece. The collectives are
asynchronous (`async_op=True`): on NCCL they run on NCCL's own stream beside the compute stream;
on gloo on gloo's thread. Backward does the same in reverse: the gradient's all-gather runs in
chunks beside the matmuls that read it, and the input gradient's reduction beside the weight
gradient's matmul.

Only rows move: a matmul is independent per row of its input (every dim but the last), so
computing it on pieces of rows and putting the pieces back where the collective would have put
them gives the same numbers as the whole matmul (each output element is the same dot product;
sums across devices are the same sums). The input's views between the collective and the matmul
only regroup rows when the last dim stays the contracted one, which the lowering checks
(lower/tp_overlap.py); the kernels take the matmul's input shape and check it again.

Matmul forms (the aten ops lowering finds): "addmm" (bias, x, w[K, N]), "mm" (x, w[K, N]),
"matmul" (x, w[K, N]) and "linear" (x, w[N, K], bias or None).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from nnscaler_plugins.kernels import reduce_scatter
from nnscaler_plugins.layout import cat_dim, chunk_dim

FORMS = ("addmm", "mm", "matmul", "linear")


# -- how many chunks ----------------------------------------------------------------------------------
def chunk_count(group: Any, overlap: Optional[bool], width: int) -> int:
    """Pieces to pipeline: the group's size when overlap is asked for (True), or by default (None)
    where the collectives run beside compute on their own stream (NCCL); one on gloo by default,
    whose collectives take the same CPU cores the matmuls use. Never more than `width` rows (the
    piece of one device along the split dim, per block) allow: the largest divisor of it."""
    if group is None or overlap is False:
        return 1
    n = dist.get_world_size(group)
    if overlap is None and "nccl" not in str(dist.get_backend(group)):
        return 1
    n = min(n, max(width, 1))
    while width % n:
        n -= 1
    return max(n, 1)


# -- one matmul on rows ---------------------------------------------------------------------------------
def _apply(form: str, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """The matmul on rows `x` (2-D)."""
    if form == "addmm":
        return torch.addmm(b, x, w)
    if form == "linear":
        return torch.nn.functional.linear(x, w, b)
    return torch.mm(x, w)


def _out_features(form: str, w: torch.Tensor) -> int:
    return w.shape[0] if form == "linear" else w.shape[1]


def _grads(form: str, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], dy: torch.Tensor,
           need: tuple[bool, bool]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(weight gradient, bias gradient) of the matmul on rows `x` (2-D) for output gradient `dy`."""
    dw = db = None
    if need[0]:
        dw = dy.t().mm(x) if form == "linear" else x.t().mm(dy)
    if need[1] and b is not None:
        db = dy if dy.shape == b.shape else dy.sum_to_size(b.shape)
    return dw, db


def _input_grad(form: str, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return dy.mm(w) if form == "linear" else dy.mm(w.t())


def _check_rows(shape: Optional[Sequence[int]], k: int, what: str) -> None:
    if shape is not None and (len(shape) < 2 or shape[-1] != k):
        raise RuntimeError(f"{what}: the matmul's input shape {list(shape)} does not keep the contracted dim "
                           f"({k}) last, so its rows are not the collective's rows; plan it with "
                           "tp_comm_overlap=False")


def _autocast(ctx: Any, like: torch.Tensor) -> Any:
    """Backward runs under the forward's autocast (matmuls in the same dtype as the forward's)."""
    kind = like.device.type
    if ctx.autocast is None:
        return torch.autocast(kind, enabled=False)
    return torch.autocast(kind, dtype=ctx.autocast)


def _autocast_state(x: torch.Tensor) -> Optional[torch.dtype]:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


# -- gathered input ---------------------------------------------------------------------------------
class _ChunkedGather:
    """The all-gather of a split input along `dim`, in `chunks` sub-pieces of every device's piece,
    each one launched asynchronously before the previous one is consumed."""

    def __init__(self, x: torch.Tensor, dim: int, blocks: int, order: tuple[int, ...], group: Any, chunks: int):
        self.dim, self.blocks, self.order, self.group, self.chunks = dim, blocks, order, group, chunks
        self.subs = [chunk_dim(x, dim, chunks, k, blocks).contiguous() for k in range(chunks)]
        self.pending: dict[int, tuple[Any, list[torch.Tensor]]] = {}

    def launch(self, k: int) -> None:
        if k < self.chunks and k not in self.pending:
            parts = [torch.empty_like(self.subs[k]) for _ in self.order]
            self.pending[k] = (dist.all_gather(parts, self.subs[k], group=self.group, async_op=True), parts)

    def take(self, k: int) -> list[torch.Tensor]:
        """Sub-piece k of every device's piece, in piece order (the next one's gather started first)."""
        self.launch(k)
        self.launch(k + 1)
        work, parts = self.pending.pop(k)
        work.wait()
        return [parts[g] for g in self.order]


def _assemble(per_chunk: list[list[torch.Tensor]], dim: int, blocks: int) -> torch.Tensor:
    """per_chunk[k][j]: sub-piece k of piece j -> the whole tensor (pieces in order, each its sub-pieces)."""
    pieces = [cat_dim([per_chunk[k][j] for k in range(len(per_chunk))], dim, blocks)
              for j in range(len(per_chunk[0]))]
    return cat_dim(pieces, dim, blocks)


def _gathered_shape(x: torch.Tensor, dim: int, n: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[dim] *= n
    return tuple(shape)


def _shaped(y: torch.Tensor, shape: list) -> torch.Tensor:
    """`y` in `shape` as a tensor of its own, not a view: a custom Function's output that is a view
    cannot be modified in place afterwards (a model's `x += ...` on the matmul's result). A fresh
    contiguous result is reshaped in place, without a copy."""
    shape = list(y.reshape(*shape).shape)  # a -1 in `shape` resolved
    if y.is_contiguous() and y._base is None:
        return y.resize_(*shape)
    return y.reshape(*shape).clone()


class _GatheredMatmuls(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        forms, shape, gather, grad, group, chunks = spec
        ws = [operands[2 * i] for i in range(len(forms))]
        bs = [operands[2 * i + 1] for i in range(len(forms))]
        ctx.spec, ctx.autocast = spec, _autocast_state(x)
        k_in = x.shape[-1]
        _check_rows(shape, k_in, "an all-gathered input's matmul")
        if gather is None or group is None:
            rows = x.reshape(-1, k_in)
            outs = [_apply(f, rows, w, b) for f, w, b in zip(forms, ws, bs)]
            full = tuple(x.shape)
        else:
            dim, blocks, order = gather
            g = _ChunkedGather(x, dim, blocks, order, group, chunks)
            per_chunk: list[list[list[torch.Tensor]]] = [[] for _ in forms]  # [matmul][chunk][piece]
            for k in range(chunks):
                parts = g.take(k)
                for i, (f, w, b) in enumerate(zip(forms, ws, bs)):
                    per_chunk[i].append([_apply(f, p.reshape(-1, k_in), w, b).view(*p.shape[:-1], -1) for p in parts])
            outs = [_assemble(pc, dim, blocks) for pc in per_chunk]
            full = _gathered_shape(x, dim, len(order))
        lead = list(shape[:-1]) if shape is not None else list(full[:-1])
        ctx.save_for_backward(x, *operands)
        return tuple(_shaped(o, [*lead, _out_features(f, w)]) for o, f, w in zip(outs, forms, ws))

    @staticmethod
    def backward(ctx: Any, *douts: Optional[torch.Tensor]) -> tuple:
        forms, shape, gather, grad, group, chunks = ctx.spec
        x, *operands = ctx.saved_tensors
        ws = [operands[2 * i] for i in range(len(forms))]
        bs = [operands[2 * i + 1] for i in range(len(forms))]
        k_in = x.shape[-1]
        gathered = gather is not None and group is not None
        with _autocast(ctx, x):
            regather = None
            if gathered:  # the input again, for the weight gradients, beside the input gradient's matmuls
                dim, blocks, order = gather
                parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in order]
                regather = (dist.all_gather(parts, x.contiguous(), group=group, async_op=True), parts)
            dys = [None if d is None else d.reshape(-1, d.shape[-1]) for d in douts]
            dx = None
            if ctx.needs_input_grad[0]:
                for f, w, dy in zip(forms, ws, dys):
                    if dy is not None:
                        part = _input_grad(f, w, dy)
                        dx = part if dx is None else dx.add_(part)
            reduction = None
            if dx is not None:
                full = _gathered_shape(x, gather[0], len(gather[2])) if gathered else tuple(x.shape)
                dx = dx.reshape(full).to(x.dtype)
                reduction = _start_input_grad_reduction(dx, grad, gather, group)
            grads_w: list[Optional[torch.Tensor]] = []
            if any(ctx.needs_input_grad[2:]):
                if regather is not None:
                    regather[0].wait()
                    xg = cat_dim([regather[1][g] for g in gather[2]], gather[0], gather[1])
                else:
                    xg = x
                rows = xg.reshape(-1, k_in)
                for i, (f, w, b, dy) in enumerate(zip(forms, ws, bs, dys)):
                    need = (ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i])
                    dw, db = _grads(f, rows, w, b, dy, need) if dy is not None else (None, None)
                    grads_w += [None if dw is None else dw.to(w.dtype), None if db is None else db.to(b.dtype)]
            else:
                if regather is not None:
                    regather[0].wait()
                grads_w = [None] * len(operands)
            dx = _finish_input_grad_reduction(reduction, dx, grad, gather, group)
        return (dx, None, *grads_w)


def _start_input_grad_reduction(dx: torch.Tensor, grad: str, gather: Optional[tuple], group: Any) -> Any:
    """The input gradient's sum over the group, started: a reduce-scatter to this device's piece
    (the input was gathered), an all-reduce (it was whole), or nothing (each device's gradient is
    already whole: keep its piece)."""
    if group is None or grad == "local":
        return None
    if grad == "reduce-scatter":
        dim, blocks, order = gather
        n = len(order)
        inputs = [chunk_dim(dx, dim, n, order.index(g), blocks) for g in range(n)]
        out = torch.empty_like(inputs[0], memory_format=torch.contiguous_format)
        return reduce_scatter.start(out, inputs, group), out, inputs
    out = dx.contiguous()
    return dist.all_reduce(out, group=group, async_op=True), out, None


def _finish_input_grad_reduction(reduction: Any, dx: Optional[torch.Tensor], grad: str, gather: Optional[tuple],
                                 group: Any) -> Optional[torch.Tensor]:
    if dx is None:
        return None
    if reduction is not None:
        reduction[0].wait()
        return reduction[1]
    if gather is not None and group is not None:  # whole on every device: this device's piece of it
        dim, blocks, order = gather
        return chunk_dim(dx, dim, len(order), order.index(dist.get_rank(group)), blocks).contiguous()
    return dx


def gathered_matmuls(x: torch.Tensor, *operands: Optional[torch.Tensor], forms: Sequence[str],
                     shape: Optional[Sequence[int]] = None, gather: Optional[tuple] = None, grad: str = "all-reduce",
                     overlap: Optional[bool] = None, group: Any = None) -> tuple[torch.Tensor, ...]:
    """Matmuls reading one input made whole for them: (w, bias or None) per form in `operands`.

    `gather` = (dim, blocks, order): `x` is this device's piece along `dim`, all-gathered over
    `group` in chunks pipelined with the matmuls (None: `x` is whole already). `grad` says what the
    input's gradient needs: "reduce-scatter" (summed over the group, this device's piece kept),
    "all-reduce" (summed, whole) or "local" (whole on every device already); the reduction runs
    beside the weight gradients' matmuls. `shape`: the matmuls' input shape (the views between the
    gather and them), None when they read the gathered tensor as it is."""
    for f in forms:
        if f not in FORMS:
            raise ValueError(f"matmul form {f!r}: use one of {', '.join(FORMS)}")
    if gather is not None:
        gather = (int(gather[0]), int(gather[1]), tuple(gather[2]))
    width = 1
    if gather is not None and group is not None:
        width = x.shape[gather[0]] // max(abs(gather[1]), 1)
    chunks = chunk_count(group, overlap, width)
    spec = (tuple(forms), None if shape is None else tuple(shape), gather, grad, group, chunks)
    return _GatheredMatmuls.apply(x, spec, *operands)


# -- reduced output ---------------------------------------------------------------------------------
class _ReducedMatmul(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], spec: tuple) -> torch.Tensor:
        form, shape, scatter, group, chunks = spec
        ctx.spec, ctx.autocast = spec, _autocast_state(x)
        k_in = x.shape[-1]
        n_out = _out_features(form, w)
        lead = list(shape[:-1]) if shape is not None else list(x.shape[:-1])
        xv = x.reshape(*lead, k_in)
        ctx.save_for_backward(x, w, b)
        if group is None:
            return _shaped(_apply(form, xv.reshape(-1, k_in), w, b), [*xv.shape[:-1], n_out])
        if scatter is None:  # all-reduce: rows in `chunks` runs, each summed while the next computes
            rows = xv.reshape(-1, k_in)
            runs = rows.tensor_split(chunks) if chunks > 1 else (rows,)
            outs, works = [], []
            for r in runs:
                y = _apply(form, r, w, b).contiguous()
                works.append(dist.all_reduce(y, group=group, async_op=True))
                outs.append(y)
            for wk in works:
                wk.wait()
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            return _shaped(y, [*xv.shape[:-1], n_out])
        dim, blocks, order = scatter
        n = len(order)
        mine = []
        works = []
        for k in range(chunks):  # sub-piece k of every device's piece, computed then reduce-scattered
            inputs = []
            for g in range(n):
                piece = chunk_dim(xv, dim, n, order.index(g), blocks)
                sub = chunk_dim(piece, dim, chunks, k, blocks) if chunks > 1 else piece
                inputs.append(_apply(form, sub.reshape(-1, k_in), w, b).view(*sub.shape[:-1], n_out))
            out = torch.empty_like(inputs[0], memory_format=torch.contiguous_format)
            works.append((reduce_scatter.start(out, inputs, group), inputs))
            mine.append(out)
        for wk, _ in works:
            wk.wait()
        y = cat_dim(mine, dim, blocks)
        return _shaped(y, list(y.shape))

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        form, shape, scatter, group, chunks = ctx.spec
        x, w, b = ctx.saved_tensors
        k_in = x.shape[-1]
        need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2] and b is not None
        with _autocast(ctx, x):
            lead = list(shape[:-1]) if shape is not None else list(x.shape[:-1])
            xv = x.reshape(*lead, k_in)
            if scatter is None or group is None:  # the output's gradient is whole on every device
                dy = dout.reshape(-1, dout.shape[-1])
                rows = xv.reshape(-1, k_in)
                dx = _input_grad(form, w, dy).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
                dw, db = _grads(form, rows, w, b, dy, (need_w, need_b))
                return dx, _cast(dw, w), _cast(db, b), None
            dim, blocks, order = scatter
            n = len(order)
            gather = _ChunkedGather(dout, dim, blocks, order, group, chunks)
            dxs: list[list[torch.Tensor]] = []
            dw = db = None
            for k in range(chunks):  # the gradient's sub-pieces gathered one ahead of the matmuls reading them
                parts = gather.take(k)
                row = []
                for j, dy in enumerate(parts):
                    piece = chunk_dim(xv, dim, n, j, blocks)
                    sub = chunk_dim(piece, dim, chunks, k, blocks) if chunks > 1 else piece
                    dy2 = dy.reshape(-1, dy.shape[-1])
                    if ctx.needs_input_grad[0]:
                        row.append(_input_grad(form, w, dy2).view(*sub.shape[:-1], k_in))
                    gw, gb = _grads(form, sub.reshape(-1, k_in), w, b, dy2, (need_w, need_b))
                    dw = gw if dw is None else (dw if gw is None else dw.add_(gw))
                    db = gb if db is None else (db if gb is None else db.add_(gb))
                dxs.append(row)
            dx = _assemble(dxs, dim, blocks).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        return dx, _cast(dw, w), _cast(db, b), None


def _cast(g: Optional[torch.Tensor], like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if g is None or like is None else g.to(like.dtype)


def reduced_matmul(form: str, *operands: Optional[torch.Tensor], shape: Optional[Sequence[int]] = None,
                   scatter: Optional[tuple] = None, overlap: Optional[bool] = None, group: Any = None) -> torch.Tensor:
    """A matmul whose output is summed over `group` (partial sums of a row-parallel matmul), the
    rows in chunks: each chunk's sum in flight while the next computes. `operands` are the form's
    own arguments in aten order ("addmm": bias, x, w; "linear": x, w, bias; "mm"/"matmul": x, w).
    `scatter` = (dim, blocks, order): a reduce-scatter along `dim` of the output viewed as `shape`
    (this device keeps its piece); None: an all-reduce."""
    if form not in FORMS:
        raise ValueError(f"matmul form {form!r}: use one of {', '.join(FORMS)}")
    if form == "addmm":
        b, x, w = operands
    elif form == "linear":
        x, w, b = (*operands, None)[:3]
    else:
        (x, w), b = operands, None
    n_out = _out_features(form, w)
    _check_rows(shape, n_out, "a reduced matmul's output")
    if scatter is not None:
        scatter = (int(scatter[0]), int(scatter[1]), tuple(scatter[2]))
    width = 1
    if group is not None:
        lead = x.shape[:-1] if shape is None else x.reshape(*shape[:-1], x.shape[-1]).shape[:-1]
        if scatter is None:  # rows of the output
            width = torch.Size(lead).numel()
        else:  # rows of one device's piece along the scattered dim, per block
            width = lead[scatter[0]] // len(scatter[2]) // max(abs(scatter[1]), 1)
    chunks = chunk_count(group, overlap, width)
    return _ReducedMatmul.apply(x, w, b, (form, None if shape is None else tuple(shape), scatter, group, chunks))

