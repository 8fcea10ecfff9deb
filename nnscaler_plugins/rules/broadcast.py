"""Label helpers shared by the rule families: broadcasting and local shape arguments."""
from __future__ import annotations

from typing import Optional, Sequence

from nnscaler_plugins.capture.graph import TensorMeta
from nnscaler_plugins.rules.signature import Labels


def out_labels(ndim: int, prefix: str = "d") -> Labels:
    return tuple(f"{prefix}{i}" for i in range(ndim))


def broadcast_labels(inp: TensorMeta, out_shape: Sequence[int], tag: str, prefix: str = "d") -> Labels:
    """Labels of an input broadcast to `out_shape`: dims equal to the output's share its label,
    broadcast (size-1) dims are frozen so they are never split."""
    n, m = len(out_shape), inp.ndim
    labs = []
    for j, s in enumerate(inp.shape):
        i = j + n - m  # an input with more dims than the output does not broadcast to it: all frozen
        labs.append(f"{prefix}{i}" if 0 <= i and s == out_shape[i] else f"^b{tag}_{j}")
    return tuple(labs)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def local_size(meta: Optional[TensorMeta]) -> list[int]:
    assert meta is not None
    return list(meta.shape)


def provider_labels(meta: TensorMeta, tag: str) -> Labels:
    """Labels of a tensor input that is not data for the op: it only provides a dtype, a device or
    a size (`x.type_as(other)`, `x.new_zeros(...)`'s self, `x.view_as(other)`). Its dims have nothing
    to do with the output's, so they are frozen under their own names and never split with it."""
    return tuple(f"^{tag}{j}" for j in range(meta.ndim))
