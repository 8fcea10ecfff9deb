"""Variable-length attention (`varlen_attn`, packed documents) has a rule: heads split, tokens whole.

The CPU build has no kernel for it (flash attention only), so this module registers a reference CPU
kernel, forward and backward (each document attended by scaled_dot_product_attention on its own),
and checks every split the rule allows against the whole op with it, forward and backward. The
real kernel's splits are a GPU check.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import nnscaler_plugins as nns
from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.rules.variable_length_attention import VARLEN_ATTENTION
from test_rules import check_random

OP = torch.ops.torch_attn._varlen_attn.default
BACKWARD = torch.ops.torch_attn._varlen_attn_backward.default


def _window(window_size):
    return (-1, -1) if window_size is None else tuple(int(w) for w in window_size)


def _documents(q, k, v, cu_q, cu_k, is_causal, scale, window):
    """Per document: (rows, queries, keys repeated per query head, values likewise, probabilities, scores)."""
    cu_k = cu_q if cu_k is None else cu_k
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        cols = slice(int(cu_k[i]), int(cu_k[i + 1]))
        qs = q[rows].transpose(0, 1)
        ks = k[cols].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[cols].transpose(0, 1).repeat_interleave(groups, 0)
        s = (qs @ ks.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        left, right = window
        right = 0 if is_causal else right
        i = torch.arange(s.shape[-2])[:, None] + (s.shape[-1] - s.shape[-2])
        j = torch.arange(s.shape[-1])[None, :]
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
        if right >= 0:
            allowed &= j <= i + right
        if left >= 0:
            allowed &= j >= i - left
        s = s.masked_fill(~allowed, float("-inf"))
        yield rows, cols, qs, ks, vs, torch.softmax(s, -1), s


def _reference(q, k, v, cu_q, cu_k, is_causal, scale, window):
    """(out, logsumexp) of each document attended on its own."""
    outs, lses = [], []
    for _, _, _, _, vs, p, s in _documents(q, k, v, cu_q, cu_k, is_causal, scale, window):
        outs.append((p @ vs).transpose(0, 1))
        lses.append(torch.logsumexp(s, -1))
    return torch.cat(outs), torch.cat(lses, dim=1).float()


def _reference_backward(grad_out, q, k, v, cu_q, cu_k, is_causal, scale, window):
    """Gradients of q, k, v, by hand (a kernel runs below autograd: it cannot differentiate itself)."""
    groups = q.shape[1] // k.shape[1]
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, qs, ks, vs, p, _ in _documents(q, k, v, cu_q, cu_k, is_causal, scale, window):
        do = grad_out[rows].transpose(0, 1)
        dp = do @ vs.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[rows] = (ds @ ks * sc).transpose(0, 1)
        dks = (ds.transpose(-1, -2) @ qs * sc)
        dvs = p.transpose(-1, -2) @ do
        dk[cols] = dks.unflatten(0, (k.shape[1], groups)).sum(1).transpose(0, 1)
        dv[cols] = dvs.unflatten(0, (v.shape[1], groups)).sum(1).transpose(0, 1)
    return dq, dk, dv


@pytest.fixture(scope="module", autouse=True)
def cpu_reference_kernel():
    """Reference CPU kernels for the op and its backward, for this module only (every build's CPU
    lacks them; the tensors here are on the CPU)."""
    lib = torch.library.Library("torch_attn", "IMPL")

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
                enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        out, lse = _reference(q, k, v, cu_q, cu_k, is_causal, scale, _window(window_size))
        return out, lse, torch.zeros(2, dtype=torch.uint64)

    def backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng_state, scale=None,
                 window_size=None):
        return _reference_backward(grad_out, q, k, v, cu_q, cu_k, is_causal, scale, _window(window_size))

    lib.impl("_varlen_attn", forward, "CPU")
    lib.impl("_varlen_attn_backward", backward, "CPU")
    yield
    del lib


def _packed(lengths, heads, kv_heads, dim=4):
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return ({"q": torch.randn(total, heads, dim), "k": torch.randn(total, kv_heads, dim),
             "v": torch.randn(total, kv_heads, dim), "cu": cu}, max(lengths))


@pytest.mark.parametrize("heads,kv_heads,causal,window", [(4, 4, True, [-1, -1]), (4, 2, False, [-1, -1]),
                                                        (4, 1, True, [-1, -1]), (2, 2, False, [2, 0])])
def test_every_split_of_packed_attention_matches_the_whole_op(heads, kv_heads, causal, window):
    tensors, longest = _packed([3, 5, 2], heads, kv_heads)
    args = (Ref("q"), Ref("k"), Ref("v"), Ref("cu"), Ref("cu"), longest, longest, causal, None, window,
            kv_heads != heads)
    check_random(OP, args, {}, tensors)


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_kernel_is_what_the_documents_give(causal):
    """The kernel the check runs against is itself right, forward and backward: each document alone
    through SDPA (grouped-query heads too)."""
    tensors, longest = _packed([3, 5], 4, 2)
    leaves = {n: tensors[n].clone().requires_grad_(True) for n in "qkv"}
    out = varlen_attn(leaves["q"], leaves["k"], leaves["v"], tensors["cu"], tensors["cu"], longest, longest,
                      window_size=(-1, 0) if causal else (-1, -1), enable_gqa=True)
    want = torch.cat([F.scaled_dot_product_attention(*(leaves[n][a:b].transpose(0, 1) for n in "qkv"),
                                                     is_causal=causal, enable_gqa=True).transpose(0, 1)
                      for a, b in ((0, 3), (3, 8))])
    torch.testing.assert_close(out, want)
    up = torch.randn(out.shape)
    got = torch.autograd.grad(out, list(leaves.values()), up)
    expected = torch.autograd.grad(want, list(leaves.values()), up)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


class PackedAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, -1).unbind(1)
        y = varlen_attn(q, k, v, cu, cu, 8, 8, window_size=(-1, 0))
        return self.out(y.reshape(t, -1)).pow(2).mean()


def test_packed_attention_captures_with_its_rule_and_splits_heads_under_tp():
    x, cu = torch.randn(12, 16), torch.tensor([0, 4, 12], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(PackedAttention(), (x, cu))
    assert not [w for w in caught if "no dimension rule" in str(w.message)], [str(w.message) for w in caught]
    ops = [op for op in graph.ops if op.op_name == VARLEN_ATTENTION]
    assert len(ops) == 1
    plan = nns.plan(graph, strategy="tp", world_size=2)
    splits = plan.ops[ops[0].name].splits
    assert splits and splits[0][0] == "h", splits
