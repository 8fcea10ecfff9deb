"""The Hugging Face plugin's hooks (registered as `builtin_hf`), kept apart from `adapters.hf` so that
loading plugins never imports transformers.

A Trainer batch is a dict that may hold keys the model's forward does not take (the Trainer drops
unused dataset columns, but collators and `num_items_in_batch` add their own); capture must see
exactly the forward's keyword arguments, so the extras are left out here.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional

from nnscaler_plugins.hookspecs import hookimpl


def _is_hf_model(model: Any) -> bool:
    return hasattr(model, "config") and hasattr(model, "main_input_name") and hasattr(model, "forward")


@hookimpl
def nnscaler_add_hookspecs(pluginmanager: Any) -> None:
    from nnscaler_plugins.hookspecs import add_hookspecs_once

    from .hookspecs import AdapterHooks

    add_hookspecs_once(pluginmanager, AdapterHooks)


@hookimpl
def nnscaler_adapt_model_for_capture(model: Any, kwargs: dict) -> Optional[Any]:
    """Transformers' FlexAttention path, made capturable (adapters/hf_flex_attention.py)."""
    if not _is_hf_model(model):
        return None
    from .hf_flex_attention import capturable_flex_attention, uses_flex_attention

    return capturable_flex_attention() if uses_flex_attention(model) else None


@hookimpl
def nnscaler_example_inputs(model: Any, batch: Any) -> Optional[Any]:
    if not (_is_hf_model(model) and isinstance(batch, Mapping)):
        return None
    params = inspect.signature(model.forward).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        # transformers 5 forwards take **kwargs: keep the keys the model itself names, plus labels.
        known = {n for n, p in params.items() if p.kind != p.VAR_KEYWORD}
    else:
        known = set(params)
    kept = {k: v for k, v in batch.items() if k in known and v is not None}
    if model.main_input_name not in kept and "inputs_embeds" not in kept:
        return None
    return kept
