"""A copy of a model's structure without its weights, to capture it again at other input sizes.

A ParallelModule serves batches of sizes its example did not have by capturing the model at a few
more sizes (see codegen/shape_template.py). It must not keep the user's weights alive for that
(a framework may drop the model after parallelizing it to free memory), so it keeps this copy:
every module, attribute and config of the model, every parameter and buffer on the meta device.
Capture traces with fake tensors, so a meta copy captures exactly like the real model.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch


def meta_skeleton(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The meta-device copy, or None when the model cannot be copied (its objects refuse deepcopy)."""
    memo: dict[int, object] = {}
    for t in list(model.parameters(recurse=True)) + list(model.buffers(recurse=True)):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - any object that refuses to be copied: no skeleton, and the caller says so
        return None
