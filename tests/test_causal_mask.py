"""Capture gives attention back its causal flag when the traced mask is a constant lower triangle,
and leaves every other mask alone (numbers must not change either way)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nnscaler_plugins.capture.tracing import capture


def _sdpa_calls(graph):
    return [op for op in graph.ops if "scaled_dot_product_attention" in str(op.target)]


class _Attn(torch.nn.Module):
    """One attention call whose mask is built inside forward by `make_mask(L, device)`."""

    def __init__(self, make_mask):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.make_mask = make_mask

    def forward(self, x, pad=None):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = self.make_mask(x.shape[1], x.device)
        if pad is not None:
            mask = mask & pad[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _run(graph_model, x, **kw):
    return graph_model(x, **kw)


def test_hf_gpt2_mask_becomes_is_causal():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 16))
    g = capture(model, {"input_ids": ids, "labels": ids})
    calls = _sdpa_calls(g)
    assert len(calls) == 2
    for op in calls:
        assert op.kwargs.get("is_causal") is True
        assert len(op.inputs) == 3  # q, k, v: the mask is gone, and so are the ops that built it


def test_constant_boolean_causal_mask_folds():
    model = _Attn(lambda n, d: torch.ones(n, n, dtype=torch.bool, device=d).tril())
    g = capture(model, (torch.randn(2, 8, 16),))
    (op,) = _sdpa_calls(g)
    assert op.kwargs.get("is_causal") is True and len(op.inputs) == 3


def test_additive_causal_mask_folds():
    def additive(n, d):
        return torch.full((n, n), float("-inf"), device=d).triu(1)
    model = _Attn(lambda n, d: additive(n, d) == 0)  # bool from a float construction
    g = capture(model, (torch.randn(2, 8, 16),))
    assert _sdpa_calls(g)[0].kwargs.get("is_causal") is True


def test_window_mask_is_kept():
    def window(n, d):
        i = torch.arange(n, device=d)
        return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
    model = _Attn(window)
    g = capture(model, (torch.randn(2, 8, 16),))
    (op,) = _sdpa_calls(g)
    assert not op.kwargs.get("is_causal") and len(op.inputs) == 4


def test_mask_that_depends_on_an_input_is_kept_and_results_match():
    import nnscaler_plugins as nns

    model = _Attn(lambda n, d: torch.ones(n, n, dtype=torch.bool, device=d).tril())
    x = torch.randn(2, 8, 16)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, 6:] = False
    g = capture(model, (x,), {"pad": pad})
    (op,) = _sdpa_calls(g)
    assert not op.kwargs.get("is_causal") and len(op.inputs) == 4
    pm = nns.parallelize(model, {"x": x, "pad": pad}, plan="dp", cache_dir="/tmp/nns_test_causal")
    torch.testing.assert_close(pm(x=x, pad=pad), model(x, pad=pad), rtol=0, atol=0)
