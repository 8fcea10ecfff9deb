"""FlexAttention is refused at capture by name, with the model's source line and the ways out
(SDPA for causal masks, varlen_attn for packed documents and sliding windows, SDPA with a mask
tensor otherwise): its mask_mod / score_mod subgraphs have no rules yet, so no split of it can be
shown exact. The CPU build runs FlexAttention forward only (no backward), so these models are
captured with frozen weights.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import nnscaler_plugins as nns
from nnscaler_plugins.capture.tracing import CaptureError

SEQ = 128  # FlexAttention's block size: the smallest sequence a block mask describes


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 32)


DOCUMENT = torch.tensor([0] * 50 + [1] * 78)


def document(b, h, q, kv):
    return (DOCUMENT[q] == DOCUMENT[kv]) & (q >= kv)


class FlexBlock(nn.Module):
    def __init__(self, mask_mod, mask_in_forward: bool, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.mask_mod, self.mask_in_forward = heads, mask_mod, mask_in_forward
        self.qkv = nn.Linear(dim, 3 * dim)
        # torchtitan builds the mask once per batch, before the model runs
        self.block_mask = create_block_mask(mask_mod, None, None, SEQ, SEQ, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(self.mask_mod, None, None, t, t, device="cpu") if self.mask_in_forward \
            else self.block_mask
        return flex_attention(q, k, v, block_mask=mask).sum()


EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
CASES = [(m, f) for m in (causal, document, sliding_window) for f in (False, True)]


@pytest.mark.parametrize("mask_mod,mask_in_forward", CASES if EVERY else [(document, True)])
def test_flex_attention_is_refused_by_name_with_the_model_line_and_the_ways_out(mask_mod, mask_in_forward):
    model = FlexBlock(mask_mod, mask_in_forward).requires_grad_(False)
    x = torch.randn(2, SEQ, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's own "called without torch.compile()"
        model(x)  # it runs eagerly on this build
        with pytest.raises(CaptureError) as err:
            nns.capture(model, (x,))
    msg = str(err.value)
    assert "FlexAttention" in msg and "test_flex_attention.py:" in msg, msg
    assert "is_causal=True" in msg and "varlen_attn" in msg, msg
