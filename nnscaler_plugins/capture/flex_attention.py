"""FlexAttention captured as one op (`kernels/flex_attention_piece.FlexAttentionCall`).

Traced, `flex_attention` becomes a higher-order op whose `score_mod` / `mask_mod` are subgraphs no
rule covers. While capturing, the function the model calls -- the attribute of
`torch.nn.attention.flex_attention` and every name a loaded module imported from it -- is replaced
by one that records a single op of q, k, v; the score function, the block mask and the settings
are held by reference (a key in the generated code). `create_block_mask` is replaced too, so a
mask built inside `forward` is built for real (capture traces with fake tensors) and held the
same way.

A mask or score function that reads a value the model computes from its inputs (a document id
per token from the end-of-sequence tokens, a padding mask) changes with every batch: those
tensors are lifted out of the function's closures and become the op's inputs after q, k, v, and
the op builds its block mask from the function each call (`kernels/flex_attention_piece.py`). A
mask made in forward by `create_block_mask` from such a function is not built while tracing: it
stands for its shape and block size until the op builds it. What cannot be run exactly is refused
by name: a function reading a tensor that needs a gradient (a learned bias would get none), a block
mask built from traced values other than by `create_block_mask`.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.attention.flex_attention as flex_module
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._python_dispatch import _disable_current_modes

from nnscaler_plugins.capture.autograd_functions import (
    FunctionCaptureError,
    opaque_call,
)
from nnscaler_plugins.kernels.flex_attention_piece import (
    FlexAttentionCall,
    FlexSpec,
    referenced_values,
    register,
)
from nnscaler_plugins.lifted_closure import LiftedClosure, lift

_NAME = "FlexAttention (torch.nn.attention.flex_attention.flex_attention)"


class FlexAttentionCaptureError(FunctionCaptureError):
    """A FlexAttention call that cannot be kept as one op; the message names it and what to do."""


def _caller() -> str:
    """The model's line that made the call, for messages."""
    frame = sys._getframe(2)
    while frame is not None:
        f = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in f and f"{os.sep}nnscaler_plugins{os.sep}" not in f:
            return f"{os.path.basename(f)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _tensors(values: list, deep: bool = False, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in `values` and in lists / tuples of them; `deep`: in dicts and objects'
    attributes too, a few levels down (where a function might find a tensor the walk of
    `lifted_closure.py` cannot give back)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(list(v), deep, depth + 1)
        elif not deep or depth > 3 or inspect.isroutine(v) or isinstance(v, (type, str, bytes, int, float)):
            continue
        elif isinstance(v, (set, frozenset)):
            yield from _tensors(list(v), deep, depth + 1)
        elif isinstance(v, dict):
            yield from _tensors(list(v.values()), deep, depth + 1)
        elif isinstance(v, torch.nn.Module):  # its plain attributes: its weights and buffers are model state
            yield from _tensors([x for k, x in vars(v).items() if k not in ("_parameters", "_buffers", "_modules")],
                                deep, depth + 1)
        elif isinstance(getattr(v, "__dict__", None), dict):
            yield from _tensors(list(vars(v).values()), deep, depth + 1)


def _traced(t: torch.Tensor) -> bool:
    """A tensor of the trace: computed in forward from the inputs, or an input."""
    return is_fake(t) or type(t).__name__ in ("FunctionalTensor", "FakeTensor")


def _check_reads(fn: Optional[Callable], what: str, where: str) -> None:
    for t in _tensors(referenced_values(fn)):
        if t.requires_grad:
            raise FlexAttentionCaptureError(
                f"{_NAME} at {where}: its {what} reads a tensor that needs a gradient ({tuple(t.shape)}); held as a "
                "constant of the op it would get none. Add the learned bias outside FlexAttention "
                "(scaled_dot_product_attention with attn_mask= the bias), or freeze it")


def _lift(fn: Optional[Callable], what: str, where: str) -> tuple[Optional[LiftedClosure], list[torch.Tensor]]:
    """The batch tensors `fn` reads, lifted out of its closures (they become the op's inputs)."""
    if fn is None:
        return None, []
    _check_reads(fn, what, where)
    lifted, tensors = lift(fn, _traced)
    left = [t for t in _tensors(referenced_values(fn), deep=True) if _traced(t)]
    if lifted is not None:  # what the lifted function still reads of the trace
        filled = lifted.fill(tuple(tensors))
        left = [t for t in _tensors(referenced_values(filled), deep=True)
                if _traced(t) and not any(t is x for x in tensors)]
    if left:  # a traced tensor the walk cannot reach: a global, or an attribute of an object
        raise FlexAttentionCaptureError(
            f"{_NAME} at {where}: its {what} reads a tensor the model computes in forward ({tuple(left[0].shape)}) "
            "other than through its closure (a global or an object's attribute), so it cannot be given to the op "
            "each call. Let the function close over the tensor (define it inside the function that computes it, "
            "as torchtitan's get_document_mask_mod does)")
    return lifted, tensors


def _check_sizes(block_mask: Any, query: torch.Tensor, where: str) -> None:
    """A mask dim must broadcast (1) or be the call's own: FlexAttention reads the first rows of a
    larger one, and the rows a data-parallel replica or a micro-batch holds are not the first."""
    for dim, what in ((0, "rows"), (1, "heads")):
        made, has = int(block_mask.shape[dim]), int(query.shape[dim])
        if made not in (1, has):
            raise FlexAttentionCaptureError(
                f"{_NAME} at {where}: its block mask was made for {made} {what} and the call has {has} (under "
                "data parallelism or micro-batches the model runs on a share of the batch). Make the mask with "
                f"{'B' if dim == 0 else 'H'}=None when it is the same for all {what}, or build it in forward "
                "for the rows it is called with")


#: masks made in forward by `create_block_mask` from a function reading batch tensors: not built
#: while tracing, only their shape and block size (the op builds them each call)
_PER_CALL: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _shape_only(mask: Any) -> Any:
    """A copy of a per-call mask with its block structure and a mask_mod that must not run (the
    op's spec keeps this; the real function reads tensors of the trace)."""
    def built_each_call(b: Any, h: Any, q: Any, kv: Any) -> Any:
        raise RuntimeError("this FlexAttention mask is built each call from the batch; its traced function is gone")

    with _untraced():
        return flex_module.BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE,
                                                    mask_mod=built_each_call, seq_lengths=mask.seq_lengths)


def _recorded_flex_attention(original: Callable) -> Callable:
    def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Any = None,
                       block_mask: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                       return_lse: bool = False, kernel_options: Optional[dict] = None, *,
                       return_aux: Any = None) -> Any:
        where = _caller()
        if return_aux is not None and any(bool(x) for x in return_aux):
            wanted = [n for n, x in zip(type(return_aux)._fields, return_aux) if x]
            if wanted != ["lse"]:
                raise FlexAttentionCaptureError(
                    f"{_NAME} at {where}: return_aux asks for {wanted}; only the log-sum-exp can be captured "
                    "(return_aux=AuxRequest(lse=True))")
        mask_lifted, mask_tensors, held_mask = None, [], block_mask
        if block_mask is not None:
            for name in block_mask._TENSOR_ATTRS:
                t = getattr(block_mask, name, None)
                if isinstance(t, torch.Tensor) and is_fake(t):
                    raise FlexAttentionCaptureError(
                        f"{_NAME} at {where}: its block mask was built from values traced in forward, not by "
                        "create_block_mask on known tensors; build it with create_block_mask (outside forward or in it)")
            mask_lifted, mask_tensors = _lift(block_mask.mask_mod, "mask_mod", where)
            if block_mask in _PER_CALL and mask_lifted is None:
                raise FlexAttentionCaptureError(f"{_NAME} at {where}: internal: a per-call block mask reads no batch tensor")
            if mask_lifted is not None:
                if tuple(block_mask.seq_lengths) != (int(query.shape[2]), int(key.shape[2])):
                    raise FlexAttentionCaptureError(
                        f"{_NAME} at {where}: its block mask, made from the batch, is for {block_mask.seq_lengths[0]} "
                        f"queries and {block_mask.seq_lengths[1]} keys and the call has {int(query.shape[2])} and "
                        f"{int(key.shape[2])}; make it with Q_LEN and KV_LEN of the call")
                held_mask = _shape_only(block_mask)
            _check_sizes(block_mask, query, where)
        score_lifted, score_tensors = _lift(score_mod, "score_mod", where)
        lse = bool(return_lse or (return_aux is not None and getattr(return_aux, "lse", False)))
        spec = FlexSpec(block_mask=held_mask, score_mod=None if score_lifted is not None else score_mod, scale=scale,
                        enable_gqa=bool(enable_gqa), return_lse=lse,
                        kernel_options=dict(kernel_options) if kernel_options else None,
                        mask_lifted=mask_lifted, score_lifted=score_lifted)
        with disable_proxy_modes_tracing(), unset_fake_temporarily():  # the key digests real tensors
            key_ = register(spec)
        out = opaque_call(FlexAttentionCall, (query, key, value, key_, 0, 0, None, *mask_tensors, *score_tensors), {})
        if return_aux is not None:
            return out[0], flex_module.AuxOutput(lse=out[1] if lse else None)
        return out

    flex_attention.__wrapped_flex__ = original  # type: ignore[attr-defined]
    return flex_attention


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Real tensors, no recording: every dispatch and torch-function mode of the tracer set aside."""
    with disable_proxy_modes_tracing(), unset_fake_temporarily(), _disable_current_modes(), \
            torch._C.DisableTorchFunction():
        yield


def _per_call_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], q_len: int, kv_len: int,
                   block_size: Any) -> Any:
    """What `create_block_mask` returns while tracing for a function reading batch tensors: every
    block of the shape present (its real blocks are the op's to build each call) and the user's
    function, so the FlexAttention call that takes it can lift the tensors out."""
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    nq, nkv = math.ceil(q_len / bq), math.ceil(kv_len / bkv)
    with _untraced():
        counts = torch.full((B or 1, H or 1, nq), nkv, dtype=torch.int32)
        indices = torch.arange(nkv, dtype=torch.int32).expand(B or 1, H or 1, nq, nkv).contiguous()
        mask = flex_module.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                                    seq_lengths=(q_len, kv_len))
    _PER_CALL.add(mask)
    return mask


def _real_create_block_mask(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def create_block_mask(mask_mod: Callable, B: Any, H: Any, Q_LEN: Any, KV_LEN: Any, device: Any = None,
                          *args: Any, **kwargs: Any) -> Any:
        where = _caller()
        _check_reads(mask_mod, "mask_mod", where)
        B, H = (None if B is None else int(B)), (None if H is None else int(H))
        if any(_traced(t) for t in _tensors(referenced_values(mask_mod), deep=True)) or _reads_traced(mask_mod):
            bound = signature.bind(mask_mod, B, H, Q_LEN, KV_LEN, device, *args, **kwargs)
            block_size = bound.arguments.get("BLOCK_SIZE", signature.parameters["BLOCK_SIZE"].default)
            return _per_call_mask(mask_mod, B, H, int(Q_LEN), int(KV_LEN), block_size)
        if isinstance(device, torch.device) and device.type == "meta":
            device = "cpu"
        with _untraced():
            return original(mask_mod, B, H, int(Q_LEN), int(KV_LEN), device, *args, **kwargs)

    return create_block_mask


def _reads_traced(fn: Callable) -> bool:
    """Whether a tensor of the trace sits anywhere in the function's closures (nested ones too)."""
    _, tensors = lift(fn, _traced)
    return bool(tensors)


@contextlib.contextmanager
def flex_attention_as_one_op() -> Iterator[None]:
    """While active, calls of `flex_attention` record one `FlexAttentionCall` op and
    `create_block_mask` builds real masks (inside `capture`, which keeps such Functions whole)."""
    originals = {"flex_attention": flex_module.flex_attention, "create_block_mask": flex_module.create_block_mask}
    replacements = {"flex_attention": _recorded_flex_attention(originals["flex_attention"]),
                    "create_block_mask": _real_create_block_mask(originals["create_block_mask"])}
    patched: list[tuple[dict, str, Any]] = []
    for mod_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        library = mod_name.startswith(("torch.", "nnscaler_plugins.")) and module is not flex_module
        if library or not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            for which, original in originals.items():
                if value is original:
                    patched.append((namespace, name, value))
                    namespace[name] = replacements[which]
    try:
        yield
    finally:
        for namespace, name, value in reversed(patched):
            namespace[name] = value
