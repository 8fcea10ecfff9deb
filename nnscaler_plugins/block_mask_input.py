"""A FlexAttention block mask passed to `forward`, carried as the tensors it is made of.

torchtitan builds its block masks outside the model, from each batch (the document mask from the
end-of-sequence tokens), and passes them in: `model(tokens, attention_masks=mask)`. A `BlockMask`
is no tensor, so neither torch.export nor a generated program can take it as it is; what makes one
batch's mask differ from another's is the data its `mask_mod` closes over. `as_inputs` turns each
`BlockMask` of a batch into a `BlockMaskInput`: a `BlockMask` (so the model's code sees one) that is
also a pytree node whose children are that data (`lifted_closure.py` lifts the closure tensors
out), plus two small tensors:

- `row_offset`: the first row of the mask the model's rows are. A micro-batch of rows [a, b) keeps
  the whole mask's data and adds `a`, so its mask reads the rows it holds whatever the function
  does with `b`.
- a digest of the function apart from its tensors (its code and the other values its closures
  hold). Capture keeps the first batch's function with the tensors as slots; a later batch whose
  function differs in more than its tensors (another window size held as an int) would be run
  with the captured one, so the mask refuses to build when the digests differ.

The FlexAttention op then takes these tensors as inputs and builds its block mask each call
(`kernels/flex_attention_piece.py`), so the carried mask's own blocks are only a placeholder with
every block present (made once per shape, outside any trace).
"""
from __future__ import annotations

import hashlib
import inspect
import math
import types
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.lifted_closure import LiftedClosure, code_of, lift

_DENSE: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _dense(rows: int, heads: int, q_len: int, kv_len: int, block_size: Any) -> tuple[torch.Tensor, ...]:
    """Every block present, for a mask of this shape: (kv counts, kv indices, q counts, q indices)."""
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    nq, nkv = math.ceil(q_len / bq), math.ceil(kv_len / bkv)
    key = (rows, heads, nq, nkv)
    if key not in _DENSE:
        _DENSE[key] = (torch.full((rows, heads, nq), nkv, dtype=torch.int32),
                       torch.arange(nkv, dtype=torch.int32).expand(rows, heads, nq, nkv).contiguous(),
                       torch.full((rows, heads, nkv), nq, dtype=torch.int32),
                       torch.arange(nq, dtype=torch.int32).expand(rows, heads, nkv, nq).contiguous())
    return _DENSE[key]


def function_digest(lifted: Optional[LiftedClosure], fn: Callable) -> int:
    """What a mask function computes apart from its lifted tensors, as a 62-bit number: its code,
    and the values its closures hold that are not lifted (by value where they are plain data)."""
    h = hashlib.sha1()
    for v in code_of(lifted.template) if lifted is not None else [fn]:
        if isinstance(v, types.CodeType):
            h.update(v.co_code)
            h.update(repr([c for c in v.co_consts if not inspect.iscode(c)]).encode())
        elif inspect.isfunction(v):
            h.update(v.__code__.co_code)
            h.update(v.__qualname__.encode())
        elif isinstance(v, torch.Tensor):
            h.update(f"{tuple(v.shape)}{v.dtype}".encode())
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, (int, float, str, bool, tuple, type(None))):
            h.update(repr(v).encode())
        else:
            h.update(type(v).__qualname__.encode())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def _rows_of(fn: Callable, row_offset: torch.Tensor, digest: torch.Tensor, expected: int) -> Callable:
    """`fn` reading rows from `row_offset`, refusing to run for another function than `expected`."""
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if int(digest) != expected:
            raise RuntimeError(
                "the block mask passed to forward was made by another function than the one captured (its code "
                "or a non-tensor value it closes over -- a window size, an id -- changed): the plan runs the captured "
                "function with this batch's tensors. Keep what changes per batch in tensors the function closes over")
        return fn(b + row_offset, h, q_idx, kv_idx)

    return mask_mod


class _Context:
    """The pytree context of a `BlockMaskInput`: equal for masks made the same way."""

    __slots__ = ("lifted", "fn", "expected", "rows", "heads", "seq_lengths", "block_size", "count")

    def __init__(self, lifted: Optional[LiftedClosure], fn: Callable, expected: int, rows: int, heads: int,
                 seq_lengths: tuple, block_size: Any, count: int) -> None:
        self.lifted, self.fn, self.expected, self.rows, self.heads = lifted, fn, expected, rows, heads
        self.seq_lengths, self.block_size, self.count = tuple(seq_lengths), block_size, count

    def _key(self) -> tuple:
        return (self.expected, self.rows, self.heads, self.seq_lengths, repr(self.block_size), self.count)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class BlockMaskInput(BlockMask):
    """A `BlockMask` from a batch, made of tensors (see the module's docstring)."""

    def __init__(self, context: _Context, row_offset: torch.Tensor, digest: torch.Tensor,
                 tensors: tuple[torch.Tensor, ...]) -> None:
        fn = context.lifted.fill(tuple(tensors)) if context.lifted is not None else context.fn
        kv_n, kv_i, q_n, q_i = _dense(context.rows, context.heads, *context.seq_lengths, context.block_size)
        super().__init__(context.seq_lengths, kv_n, kv_i, None, None, q_n, q_i, None, None, context.block_size,
                         _rows_of(fn, row_offset, digest, context.expected))
        self.context, self.row_offset, self.digest, self.tensors = context, row_offset, digest, tuple(tensors)

    def children(self) -> list[torch.Tensor]:
        return [self.row_offset, self.digest, *self.tensors]

    def child(self, index: int) -> torch.Tensor:
        """The tensor at `index` of `children()` (a graph input's path steps through it)."""
        return self.children()[index]

    def rows(self, start: int, stop: int) -> "BlockMaskInput":
        """The mask of rows [start, stop) of the batch (a micro-batch): the same data, read from
        row `row_offset + start`; a mask broadcast over rows is the same mask."""
        if self.context.rows == 1:
            return self
        c = self.context
        context = _Context(c.lifted, c.fn, c.expected, stop - start, c.heads, c.seq_lengths, c.block_size, c.count)
        return BlockMaskInput(context, self.row_offset + start, self.digest, self.tensors)


def _flatten(m: BlockMaskInput) -> tuple[list[torch.Tensor], _Context]:
    return m.children(), m.context


def _unflatten(children: Any, context: _Context) -> BlockMaskInput:
    children = list(children)
    return BlockMaskInput(context, children[0], children[1], tuple(children[2:]))


def _flatten_with_keys(m: BlockMaskInput) -> tuple[list[tuple[Any, torch.Tensor]], _Context]:
    return [(pytree.SequenceKey(i), t) for i, t in enumerate(m.children())], m.context


pytree.register_pytree_node(BlockMaskInput, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys)


def from_block_mask(mask: BlockMask, where: str = "") -> BlockMaskInput:
    """A user's `BlockMask` as a `BlockMaskInput` (its closure tensors lifted out)."""
    if isinstance(mask, BlockMaskInput):
        return mask
    if mask.mask_mod is noop_mask:
        raise PlanError(f"the block mask {where or 'passed to forward'} was made from explicit block indices "
                        "(BlockMask.from_kv_blocks without a mask_mod): a plan builds each piece's mask from the "
                        "mask's function. Make it with create_block_mask(mask_mod, ...)")
    lifted, tensors = lift(mask.mask_mod, lambda t: True)
    if any(t.requires_grad for t in tensors):
        raise PlanError(f"the block mask {where or 'passed to forward'} closes over a tensor that needs a gradient; "
                        "a mask is data of the batch. Detach it, or add a learned bias outside FlexAttention")
    rows, heads = int(mask.shape[0]), int(mask.shape[1])
    expected = function_digest(lifted, mask.mask_mod)
    device = tensors[0].device if tensors else mask.kv_num_blocks.device
    context = _Context(lifted, mask.mask_mod if lifted is None else None, expected, rows, heads,
                       tuple(mask.seq_lengths), mask.BLOCK_SIZE, len(tensors))
    return BlockMaskInput(context, torch.zeros((), dtype=torch.int64, device=device),
                          torch.tensor(expected, dtype=torch.int64, device=device), tuple(tensors))


def as_inputs(value: Any, where: str = "") -> Any:
    """`value` with every `BlockMask` in it (in dicts, lists and tuples) a `BlockMaskInput`;
    `value` itself where it holds none."""
    if not holds_block_mask(value):
        return value
    if isinstance(value, BlockMask):
        return from_block_mask(value, where)
    if isinstance(value, dict):
        return {k: as_inputs(v, f"{where}[{k!r}]" if where else repr(k)) for k, v in value.items()}
    return type(value)(as_inputs(v, f"{where}[{i}]") for i, v in enumerate(value))


def holds_block_mask(value: Any) -> bool:
    """Whether a `BlockMask` not yet carried as tensors is in `value` (dicts, lists, tuples)."""
    if isinstance(value, BlockMask):
        return not isinstance(value, BlockMaskInput)
    if isinstance(value, dict):
        return any(holds_block_mask(v) for v in value.values())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return any(holds_block_mask(v) for v in value)
    return False
