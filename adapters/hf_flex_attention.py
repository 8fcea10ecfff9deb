"""Hugging Face models on FlexAttention (`attn_implementation="flex_attention"`), made capturable.

Two things in transformers' flex path stop a trace, and neither changes what the model computes:

- `masking_utils.flex_attention_mask` adds the padding mask only when the attention mask is not
  all ones, which it decides by reading the mask's values (`fast_all`). Its sdpa siblings skip that
  test while tracing (`is_tracing`); here the flex one does too: while capturing, a traced mask
  counts as not all ones, so the padding function is always part of the mask. A row without
  padding is masked by nothing more, so the result is the same for every batch, and the padding
  tensor reaches the FlexAttention op as its input (`kernels/flex_attention_piece.py`).
- `integrations.flex_attention.compile_friendly_flex_attention` calls `torch.compile(flex_attention)`,
  which capture cannot keep as one op. While capturing it calls `flex_attention` itself, which
  capture records as one op; the generated code runs the op's own kernel.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


def uses_flex_attention(model: Any) -> bool:
    """Whether a Hugging Face model (or a submodule's config) asks for FlexAttention."""
    for m in model.modules() if hasattr(model, "modules") else [model]:
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == "flex_attention":
            return True
    return False


@contextlib.contextmanager
def capturable_flex_attention() -> Iterator[None]:
    import torch
    import torch.nn.attention.flex_attention as flex_module
    from transformers import masking_utils
    from transformers.integrations import flex_attention as hf_flex

    original_all, original_call = masking_utils.fast_all, getattr(hf_flex, "compile_friendly_flex_attention", None)

    def fast_all(tensor: Any) -> Any:
        if masking_utils.is_tracing(tensor):
            return False  # as the sdpa paths do while tracing: keep the padding function in the mask
        return original_all(tensor)

    def compile_friendly_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                        training: bool = False, **kwargs: Any) -> Any:
        return flex_module.flex_attention(query, key, value, **kwargs)  # looked up now: capture's recorder

    masking_utils.fast_all = fast_all
    if original_call is not None:
        hf_flex.compile_friendly_flex_attention = compile_friendly_flex_attention
    try:
        yield
    finally:
        masking_utils.fast_all = original_all
        if original_call is not None:
            hf_flex.compile_friendly_flex_attention = original_call
