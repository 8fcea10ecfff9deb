"""FlexAttention as one op, and what a piece of it runs (batch rows and/or heads of the whole call).

Why one op: `flex_attention(q, k, v, score_mod, block_mask)` calls the user's `score_mod` and the
block mask's `mask_mod` on (batch, head, query, key) indices; traced, they become subgraphs the
plan cannot split. Kept whole, the call has a plain rule (`rules/flex_attention.py`): batch rows
and heads are independent, so piece (b0.., h0..) of the inputs gives that piece of the output,
provided the piece sees the *global* indices. `flex_attention_piece` arranges that: its block mask
is the whole mask's rows / heads for the piece (or the same mask where the mask broadcasts a dim of
size 1), and both user functions are called with `b + batch_start`, `h + head_start`.

A piece may also hold some of the queries (context parallelism): `query_chunks` names the global
query positions it holds, as (start, length) ranges in order (one range for a contiguous split, two
for the mirrored split that balances a causal mask). Its keys and values are the whole sequence, so
the piece is exact for any mask or score function once they see global query indices: the piece's
block mask is built again from the mask's `mask_mod` over its own queries (a block mask cannot be
sliced along queries at arbitrary positions), cached per piece.

The score function, the block mask and the settings are held by reference in a process-local
registry under a digest of what they compute (as the experts op holds its module): the generated
code names the key, and the model must be captured in the process that runs it (`nns.parallelize`
does).

A mask made from the batch (a document id per token from the end-of-sequence tokens, a padding
mask) changes every call, so it cannot be held: the tensors its `mask_mod` closes over that come
from the batch are the op's inputs after q, k, v (`lifted_closure.py` takes them out of the
closures at capture and puts them back each call), and each call builds its block mask from the
function filled with them, for the piece's rows, heads and queries -- once per batch: the layers
of a step share the build. The same holds for a `score_mod` reading such tensors. These inputs are
whole on every piece, so `mask_mod(b + batch_start, ...)` reads the right rows.

Forward runs `flex_attention` without recording; backward recomputes it with autograd, which
gives exactly FlexAttention's own gradients (on devices where FlexAttention has a backward: the
CPU build has none and raises torch's own message).
"""
from __future__ import annotations

import hashlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask

from nnscaler_plugins.lifted_closure import LiftedClosure, code_of

#: The function the model calls, kept before capture replaces the name while tracing.
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention


@dataclass(eq=False)
class FlexSpec:
    """Everything of one `flex_attention` call that is not q, k, v."""

    block_mask: Optional[BlockMask]
    score_mod: Optional[Callable]
    scale: Optional[float]
    enable_gqa: bool
    return_lse: bool
    kernel_options: Optional[dict]
    #: a mask built each call from tensors of the batch: its function with them lifted out, and
    #: how it was made (`block_mask` then only says its shape and block size)
    mask_lifted: Optional[LiftedClosure] = None
    #: a score function reading tensors of the batch, with them lifted out
    score_lifted: Optional[LiftedClosure] = None
    lifted_counts: tuple[int, int] = field(init=False, default=(0, 0))

    def __post_init__(self) -> None:
        self.lifted_counts = (self.mask_lifted.count if self.mask_lifted else 0,
                              self.score_lifted.count if self.score_lifted else 0)


_SPECS: dict[str, FlexSpec] = {}


#: objects a digest met, by id, with the order they were first met in (kept alive, so an id is
#: never another object's): every rank captures the same model in the same order, so an object
#: gets the same number on every rank, where its address differs from process to process
_OBJECTS: dict[int, tuple[int, Any]] = {}


def _object_token(v: Any) -> str:
    """What a digest says of an object it does not read into (a module, a config): its type and
    the order it was first met in this process."""
    if id(v) not in _OBJECTS:
        _OBJECTS[id(v)] = (len(_OBJECTS), v)
    return f"{type(v).__qualname__}#{_OBJECTS[id(v)][0]}"


def _digest_tensor(h: Any, t: torch.Tensor) -> None:
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def referenced_values(fn: Any) -> list[Any]:
    """What a user function reads besides its arguments: closure cells, defaults, and the globals
    its code names (recursively through nested code objects)."""
    if fn is None:
        return []
    fn = inspect.unwrap(fn) if callable(fn) else fn
    out: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:
            pass
    out += list(getattr(fn, "__defaults__", None) or ())
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        out += [glb[n] for n in c.co_names if n in glb and not inspect.ismodule(glb[n])]
        stack += [k for k in c.co_consts if inspect.iscode(k)]
    if code is None and hasattr(fn, "__dict__"):  # a callable object: its attributes
        out += list(vars(fn).values())
    return out


def _digest_function(h: Any, fn: Any, depth: int = 0) -> None:
    if fn is None:
        h.update(b"none")
        return
    h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}".encode())
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is not None:
        h.update(code.co_code)
        h.update(repr([c for c in code.co_consts if not inspect.iscode(c)]).encode())
    for v in referenced_values(fn):
        if isinstance(v, torch.Tensor):
            _digest_tensor(h, v)
        elif callable(v) and depth < 3:
            _digest_function(h, v, depth + 1)
        elif isinstance(v, (int, float, str, bool, tuple, type(None))):
            h.update(repr(v).encode())
        else:
            h.update(_object_token(v).encode())


def _digest_lifted(h: Any, lifted: LiftedClosure) -> None:
    h.update(repr(lifted.shapes).encode())
    for v in code_of(lifted.template):
        if isinstance(v, types.CodeType):
            h.update(v.co_code)
            h.update(repr([c for c in v.co_consts if not inspect.iscode(c)]).encode())
        elif isinstance(v, torch.Tensor):
            _digest_tensor(h, v)
        elif callable(v):
            _digest_function(h, v)
        else:
            h.update(repr(v).encode() if isinstance(v, (int, float, str, bool, tuple, type(None)))
                     else _object_token(v).encode())


def register(spec: FlexSpec) -> str:
    """The key generated code names this call's mask, score function and settings by: a digest of
    what they compute, so equal calls share it (and a cached file stays valid) and different ones
    never do."""
    h = hashlib.sha1()
    if spec.score_lifted is not None:
        _digest_lifted(h, spec.score_lifted)
    else:
        _digest_function(h, spec.score_mod)
    m = spec.block_mask
    if m is not None:
        h.update(repr((m.seq_lengths, m.BLOCK_SIZE, tuple(m.shape))).encode())
        if spec.mask_lifted is not None:
            _digest_lifted(h, spec.mask_lifted)
        else:
            for name in BlockMask._TENSOR_ATTRS:
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor):
                    _digest_tensor(h, t)
            _digest_function(h, m.mask_mod)
    h.update(repr((spec.scale, spec.enable_gqa, spec.return_lse, sorted((spec.kernel_options or {}).items()))).encode())
    key = f"flex{h.hexdigest()[:16]}"
    _SPECS.setdefault(key, spec)
    return key


def spec_of(key: str) -> FlexSpec:
    try:
        return _SPECS[key]
    except KeyError:
        raise RuntimeError(f"FlexAttention call {key!r} is not known in this process: the model must be captured "
                           "here (nns.parallelize does) before the generated code runs") from None


QueryChunks = tuple[tuple[int, int], ...]


def global_query(q: Any, chunks: QueryChunks) -> Any:
    """The global position of local query index `q` (a tensor of indices inside FlexAttention's
    functions) for a piece holding `chunks`: (start, length) ranges laid end to end locally."""
    (start, length), rest = chunks[0], chunks[1:]
    out = q + start
    local = length
    for start, length in rest:
        out = torch.where(q >= local, q - local + start, out)
        local += length
    return out


def _offset_mask_mod(fn: Callable, b0: int, h0: int, chunks: Optional[QueryChunks] = None) -> Callable:
    """`fn` seeing global indices: rows from `b0`, heads from `h0`, queries at `chunks` (None: as given)."""
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return fn(b + b0, h + h0, q if chunks is None else global_query(q, chunks), kv)
    return mask_mod


def _offset_score_mod(fn: Callable, b0: int, h0: int, chunks: Optional[QueryChunks] = None) -> Callable:
    def score_mod(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return fn(score, b + b0, h + h0, q if chunks is None else global_query(q, chunks), kv)
    return score_mod


def rebuildable(mask: Optional[BlockMask]) -> bool:
    """Whether a piece holding some of the queries can have its block mask built again: the mask's
    blocks come from its `mask_mod` (a mask made from explicit block indices carries torch's no-op
    mask_mod, and its blocks say more than that function)."""
    from torch.nn.attention.flex_attention import noop_mask

    return mask is None or mask.mask_mod is not noop_mask


_QUERY_MASKS: dict[tuple, BlockMask] = {}


def query_piece_mask(mask: BlockMask, batch_start: int, batch: int, head_start: int, heads: int,
                     chunks: QueryChunks, kv_len: int, device: torch.device) -> BlockMask:
    """The block mask of a piece holding rows [batch_start, +batch), query heads [head_start,
    +heads) and the global queries `chunks`, built from the whole mask's `mask_mod` (cached)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mb, mh = mask.shape[0], mask.shape[1]
    b0, h0 = (0 if mb == 1 else batch_start), (0 if mh == 1 else head_start)
    length = sum(n for _, n in chunks)
    key = (id(mask), b0, h0, None if mb == 1 else batch, None if mh == 1 else heads, chunks, kv_len, str(device))
    if key not in _QUERY_MASKS:
        _QUERY_MASKS[key] = create_block_mask(
            _offset_mask_mod(mask.mask_mod, b0, h0, chunks), None if mb == 1 else batch, None if mh == 1 else heads,
            length, kv_len, device=device, BLOCK_SIZE=mask.BLOCK_SIZE)
    return _QUERY_MASKS[key]


def piece_mask(mask: Optional[BlockMask], batch_start: int, batch: int, head_start: int, heads: int) -> Optional[BlockMask]:
    """The block mask of rows [batch_start, +batch) and query heads [head_start, +heads): sliced
    along a dim the mask holds per row / head, kept where it broadcasts (size 1); its mask_mod sees
    global indices."""
    if mask is None or (batch_start == 0 and head_start == 0 and tuple(mask.shape[:2]) in
                        ((batch, heads), (1, heads), (batch, 1), (1, 1))):
        return mask
    mb, mh = mask.shape[0], mask.shape[1]
    rows = slice(None) if mb == 1 else slice(batch_start, batch_start + batch)
    hs = slice(None) if mh == 1 else slice(head_start, head_start + heads)
    local = mask[rows, hs]
    local.mask_mod = _offset_mask_mod(mask.mask_mod, 0 if mb == 1 else batch_start, 0 if mh == 1 else head_start)
    return local


_LIFTED_MASKS: dict[tuple, tuple[tuple, BlockMask]] = {}


def _same_tensors(a: tuple, b: tuple) -> bool:
    """Whether two calls read the same batch: the same storage, unchanged (the cache holds the
    tensors, so a storage cannot be reused for another batch while its entry lives)."""
    return len(a) == len(b) and all(
        x.data_ptr() == y.data_ptr() and x._version == y._version and x.shape == y.shape and x.stride() == y.stride()
        and x.dtype == y.dtype for x, y in zip(a, b))


def lifted_piece_mask(key: str, spec: FlexSpec, tensors: tuple, batch_start: int, batch: int, head_start: int,
                      heads: int, chunks: Optional[QueryChunks], q_len: int, kv_len: int,
                      device: torch.device) -> BlockMask:
    """The block mask of a piece, built from the mask's function filled with this call's batch
    tensors: rows [batch_start, +batch), heads [head_start, +heads) (where the mask has those dims)
    and the piece's queries. Built once per batch: the next call with the same tensors (the next
    layer, the backward) reuses it."""
    from torch.nn.attention.flex_attention import create_block_mask

    made = spec.block_mask
    mb, mh = made.shape[0], made.shape[1]
    b0, h0 = (0 if mb == 1 else batch_start), (0 if mh == 1 else head_start)
    where = (key, b0, h0, None if mb == 1 else batch, None if mh == 1 else heads, chunks, q_len, kv_len, str(device))
    hit = _LIFTED_MASKS.get(where)
    if hit is not None and _same_tensors(hit[0], tensors):
        return hit[1]
    fn = _offset_mask_mod(spec.mask_lifted.fill(tensors), b0, h0, chunks)
    mask = create_block_mask(fn, None if mb == 1 else batch, None if mh == 1 else heads, q_len, kv_len,
                             device=device, BLOCK_SIZE=made.BLOCK_SIZE)
    _LIFTED_MASKS[where] = (tuple(t.detach() for t in tensors), mask)
    return mask


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str, batch_start: int, head_start: int,
         query_chunks: Optional[QueryChunks] = None, lifted: tuple = ()) -> Any:
    spec = spec_of(key)
    n_mask = spec.lifted_counts[0]
    whole_queries = query_chunks is None
    if spec.mask_lifted is not None:
        mask = lifted_piece_mask(key, spec, lifted[:n_mask], batch_start, q.shape[0], head_start, q.shape[1],
                                 query_chunks, q.shape[2], k.shape[-2], q.device)
    elif whole_queries:
        mask = piece_mask(spec.block_mask, batch_start, q.shape[0], head_start, q.shape[1])
        if mask is not None and mask.kv_num_blocks.device != q.device:
            mask = mask.to(q.device)
    else:
        mask = None if spec.block_mask is None else query_piece_mask(
            spec.block_mask, batch_start, q.shape[0], head_start, q.shape[1], query_chunks, k.shape[-2], q.device)
    score_mod = spec.score_lifted.fill(lifted[n_mask:]) if spec.score_lifted is not None else spec.score_mod
    if score_mod is not None and (batch_start or head_start or not whole_queries):
        score_mod = _offset_score_mod(score_mod, batch_start, head_start, query_chunks)
    return torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=spec.scale,
                                enable_gqa=spec.enable_gqa, return_lse=spec.return_lse,
                                kernel_options=spec.kernel_options)


class FlexAttentionCall(torch.autograd.Function):
    """`FlexAttentionCall.apply(q, k, v, key, batch_start=0, head_start=0, query_chunks=None,
    *lifted)`: FlexAttention on rows from `batch_start`, query heads from `head_start` and the
    global queries `query_chunks` (None: all of them) of the whole call registered under `key`,
    its mask (then score function) reading the batch tensors `lifted`; returns the output, or
    (output, log-sum-exp) when the call asked for it."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str, batch_start: int = 0,
                head_start: int = 0, query_chunks: Optional[QueryChunks] = None, *lifted: torch.Tensor) -> Any:
        spec = spec_of(key)
        if torch._subclasses.fake_tensor.is_fake(q) or q.device.type == "meta":
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # capture only needs the shapes
            return (out, q.new_empty(q.shape[:-1], dtype=torch.float32)) if spec.return_lse else out
        with torch.no_grad():
            return _run(q.detach(), k.detach(), v.detach(), key, batch_start, head_start, query_chunks,
                        tuple(t.detach() for t in lifted))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        q, k, v, key, *rest = inputs
        starts, lifted = (tuple(rest[:3]) + (0, 0, None))[:3], tuple(rest[3:])
        ctx.save_for_backward(q, k, v, *lifted)
        ctx.key, ctx.starts, ctx.lifted = key, starts, len(lifted)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        q, k, v, *lifted = ctx.saved_tensors
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = _run(q, k, v, ctx.key, *ctx.starts, tuple(t.detach() for t in lifted))
        outs = list(out) if isinstance(out, tuple) else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        dq, dk, dv = torch.autograd.grad([o for o, _ in pairs], (q, k, v), [g for _, g in pairs], allow_unused=True)
        return (dq, dk, dv, None, None, None, None) + (None,) * ctx.lifted


def flex_attention_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str, batch_start: int,
                         head_start: int, query_chunks: Optional[QueryChunks] = None, *lifted: torch.Tensor) -> Any:
    """What a piece of a split FlexAttention op runs (generated code calls it by name)."""
    return FlexAttentionCall.apply(q, k, v, key, batch_start, head_start, query_chunks, *lifted)


def query_chunks_of(length: int, pieces: int, index: int, blocks: int) -> QueryChunks:
    """The global query ranges piece `index` of `pieces` holds of a sequence of `length` split with
    the plan's `blocks`: 1 contiguous; b > 1 the index-th share of each of b equal blocks; -2 the
    mirrored split (chunks index and 2 x pieces - 1 - index of 2 x pieces)."""
    if blocks == -2:
        c = length // (2 * pieces)
        return ((index * c, c), ((2 * pieces - 1 - index) * c, c))
    b = max(blocks, 1)
    block, share = length // b, length // b // pieces
    return tuple((i * block + index * share, share) for i in range(b))
