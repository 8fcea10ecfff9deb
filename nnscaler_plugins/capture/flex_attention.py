"""FlexAttention captured as one op (`kernels/flex_attention_piece.FlexAttentionCall`).

Traced, `flex_attention` becomes a higher-order op whose `score_mod` / `mask_mod` are subgraphs no
rule covers. While capturing, the function the model calls -- the attribute of
`torch.nn.attention.flex_attention` and every name a loaded module imported from it -- is replaced
by one that records a single op of q, k, v; the score function, the block mask and the settings
are held by reference (a key in the generated code). `create_block_mask` is replaced too, so a
mask built inside `forward` is built for real (capture traces with fake tensors) and held the
same way.

What cannot be held as a constant is refused by name: a mask or score function that reads a
value the model computes from its inputs (it changes every batch), or one that reads a tensor
needing a gradient (a learned bias would get none).
"""
from __future__ import annotations

import contextlib
import os
import sys
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


def _tensors(values: list) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(list(v))


def _check_reads(fn: Optional[Callable], what: str, where: str) -> None:
    for t in _tensors(referenced_values(fn)):
        if t.requires_grad:
            raise FlexAttentionCaptureError(
                f"{_NAME} at {where}: its {what} reads a tensor that needs a gradient ({tuple(t.shape)}); held as a "
                "constant of the op it would get none. Add the learned bias outside FlexAttention "
                "(scaled_dot_product_attention with attn_mask= the bias), or freeze it")
        if is_fake(t) or type(t).__name__ in ("FunctionalTensor", "FakeTensor"):
            raise FlexAttentionCaptureError(
                f"{_NAME} at {where}: its {what} reads a tensor the model computes in forward (or an input), so it "
                "changes with every batch and cannot be held as a constant of the op. Build the mask outside "
                "forward from tensors known before capture (a buffer or a global, like torchtitan's per-batch "
                "mask set before the model runs), or use torch.nn.attention.varlen.varlen_attn for packed documents")


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
        if block_mask is not None:
            for name in block_mask._TENSOR_ATTRS:
                t = getattr(block_mask, name, None)
                if isinstance(t, torch.Tensor) and is_fake(t):
                    raise FlexAttentionCaptureError(
                        f"{_NAME} at {where}: its block mask was built from values traced in forward, not by "
                        "create_block_mask on known tensors; build it with create_block_mask (outside forward or in it)")
            _check_reads(block_mask.mask_mod, "mask_mod", where)
            _check_sizes(block_mask, query, where)
        _check_reads(score_mod, "score_mod", where)
        lse = bool(return_lse or (return_aux is not None and getattr(return_aux, "lse", False)))
        spec = FlexSpec(block_mask=block_mask, score_mod=score_mod, scale=scale, enable_gqa=bool(enable_gqa),
                        return_lse=lse, kernel_options=dict(kernel_options) if kernel_options else None)
        with disable_proxy_modes_tracing(), unset_fake_temporarily():  # the key digests real tensors
            key_ = register(spec)
        out = opaque_call(FlexAttentionCall, (query, key, value, key_), {})
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


def _real_create_block_mask(original: Callable) -> Callable:
    def create_block_mask(mask_mod: Callable, B: Any, H: Any, Q_LEN: Any, KV_LEN: Any, device: Any = None,
                          *args: Any, **kwargs: Any) -> Any:
        _check_reads(mask_mod, "mask_mod", _caller())
        if isinstance(device, torch.device) and device.type == "meta":
            device = "cpu"
        with _untraced():
            return original(mask_mod, None if B is None else int(B), None if H is None else int(H), int(Q_LEN),
                            int(KV_LEN), device, *args, **kwargs)

    return create_block_mask


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
