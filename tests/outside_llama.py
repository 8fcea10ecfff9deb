"""Llama written the way its projects write it (written here, not copied; no framework imported).

- `ReferenceLlama`: the style of Meta's Llama reference code, for training (no KV cache): RoPE with
  complex numbers (`precompute_freqs_cis` by `torch.polar`, `view_as_complex`, a complex multiply,
  `view_as_real`), kept as a plain tensor attribute; `repeat_kv` for grouped-query attention;
  attention written out as matmul, a causal mask built by `torch.full` and `torch.triu` and added,
  softmax in float; its own RMSNorm class; the SwiGLU feed-forward sized by `multiple_of`.
- `TitanLlama`: torchtitan's Llama 3: the same complex RoPE, the table a persistent buffer;
  `nn.RMSNorm`; layers in a `ModuleDict`; attention by `scaled_dot_product_attention` (causal) or by
  FlexAttention with the block mask passed to `forward` as `attention_masks` (built outside the
  model by `create_block_mask`: causal, document -- from the end-of-sequence tokens of the batch --
  or sliding window); `forward(tokens)` returns the logits and the loss is computed outside, so
  `WithLoss` wraps it as a training script would.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                      head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------------------------------
# The reference-code style
# --------------------------------------------------------------------------------------------------

class ReferenceAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class ReferenceBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, multiple_of: int, eps: float):
        super().__init__()
        self.attention = ReferenceAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 4 * dim, multiple_of)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class ReferenceLlama(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 multiple_of: int = 16, norm_eps: float = 1e-5, max_seq_len: int = 32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([ReferenceBlock(dim, n_heads, n_kv_heads, multiple_of, norm_eps)
                                     for _ in range(n_layers)])
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(dim // n_heads, max_seq_len * 2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[:seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# --------------------------------------------------------------------------------------------------
# torchtitan's Llama 3
# --------------------------------------------------------------------------------------------------

class TitanAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, use_flex_attn: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.use_flex_attn = use_flex_attn

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks=None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis[:seqlen])
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.use_flex_attn:
            from torch.nn.attention.flex_attention import flex_attention

            output = flex_attention(xq, xk, xv, block_mask=attention_masks)
        else:
            output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, multiple_of: int, eps: float, use_flex_attn: bool):
        super().__init__()
        self.attention = TitanAttention(dim, n_heads, n_kv_heads, use_flex_attn)
        self.feed_forward = FeedForward(dim, 4 * dim, multiple_of)
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 multiple_of: int = 16, norm_eps: float = 1e-5, max_seq_len: int = 64, rope_theta: float = 500000.0,
                 use_flex_attn: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len, rope_theta),
                             persistent=True)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_heads, n_kv_heads, multiple_of, norm_eps,
                                                        use_flex_attn) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, attention_masks=None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks)
        return self.output(self.norm(h))


def get_document_mask_mod(batch: torch.Tensor, eos_id: int):
    """torchtitan's document mask, made from the batch outside the model: a document ends at each
    end-of-sequence token."""
    eos_mask = batch == eos_id
    eos_mask[:, -1] = True
    cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
    sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
    sequence_indices[:, 1:] = cumulative_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

    return document_mask


class WithLoss(nn.Module):
    """The training script's loss around a model that returns logits (torchtitan's cross_entropy_loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        pred = self.model(tokens, **kwargs)
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


VOCAB, BATCH, SEQ = 64, 4, 16


def _tokens() -> dict:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    return {"tokens": ids, "labels": torch.roll(ids, -1, 1)}


def reference_llama():
    batch = _tokens()
    return ReferenceLlama(), {"tokens": batch["tokens"], "targets": batch["labels"]}


def titan_llama():
    return WithLoss(TitanLlama()), _tokens()
