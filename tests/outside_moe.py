"""Mixture-of-experts layers written the way torchtitan and Megatron-Core write theirs (written here,
not copied; no framework imported): tokens sorted by expert, per-expert counts from `histc` or a sum
of the routing map, split sizes read with `.tolist()` inside the experts module, then one grouped
matmul (`torch._grouped_mm`) or a loop over the experts.

- `TitanMoE`: torchtitan's layout. A top-k router (sigmoid or softmax scores, `histc` counts), a
  token reorderer (`argsort` of the chosen experts), `gather` of the routed rows, `GroupedExperts`
  with stacked weights `w1, w2, w3` of shape (experts, ...) run by `_grouped_mm` (on GPU) or by a
  loop over `torch.split` of the rows (the CPU form), a shared expert, and `scatter_add` back.
- `MegatronMoE`: Megatron-Core's layout. A router giving dense `probs` and a boolean `routing_map`
  (tokens x experts), `permute` by `masked_select` of token indices per expert (the size told to
  torch with `torch._check`, as the count of routed rows is known), `SequentialMLP` -- a
  `ModuleList` of per-expert MLPs called on `torch.split` pieces of the sorted rows -- returning
  `(output, bias)`, and `unpermute` weighting the rows by their probabilities and `scatter_add`-ing
  them back. With `grouped=True` the experts are `GroupedMLP`: weights stacked (experts, hidden,
  2 x ffn) and (experts, ffn, hidden), stored input-major, called with the permuted probabilities
  as a third argument and applying them inside (after the gated activation), a loop over
  `torch.split` standing in for the grouped GEMM library.

Both take `(B, S, H)` hidden states; the small language models around them (`titan_moe_lm`,
`megatron_moe_lm`) put one such layer in each of two blocks, with the loss computed in the model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------------------------------
# torchtitan's layout
# --------------------------------------------------------------------------------------------------

class FeedForward(nn.Module):
    """The dense SwiGLU block (and the shared expert)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def experts_by_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    counts = [int(n) for n in num_tokens_per_expert.tolist()]  # a host sync, as in torchtitan
    pieces = torch.split(x[: sum(counts)], counts, dim=0)
    outs = []
    for e, rows in enumerate(pieces):
        h = F.silu(torch.matmul(rows, w1[e].transpose(-2, -1)))
        h = h * torch.matmul(rows, w3[e].transpose(-2, -1))
        outs.append(torch.matmul(h, w2[e].transpose(-2, -1)))
    out = torch.cat(outs, dim=0)
    padding = x.shape[0] - sum(counts)
    return torch.vstack((out, out.new_zeros((padding, out.shape[-1]))))


def experts_by_grouped_mm(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                          num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.2)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        run = experts_by_grouped_mm if self.use_grouped_mm else experts_by_loop
        return run(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str = "sigmoid",
                 route_norm: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm = score_func, route_norm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        else:
            scores = F.softmax(scores.to(torch.float32), dim=1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        # histc on CPU takes floating input (CUDA also counts integers)
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts


class TokenReorderer(nn.Module):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, top_scores: torch.Tensor, selected: torch.Tensor):
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        order = torch.argsort(selected.view(-1), stable=True)
        scores_sorted = top_scores.view(-1)[order]
        return scores_sorted, order // self.top_k, counts


class TitanMoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int = 4, top_k: int = 2, shared: bool = True,
                 score_before_experts: bool = True, use_grouped_mm: bool = False, score_func: str = "sigmoid",
                 count_tokens: bool = True):
        super().__init__()
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, score_func)
        self.reorderer = TokenReorderer(num_experts, top_k)
        self.shared_experts = FeedForward(dim, hidden_dim) if shared else None
        self.score_before_experts = score_before_experts
        self.count_tokens = count_tokens
        # what the auxiliary-loss-free load balancing reads between steps
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, counts = self.router(x)
        if self.count_tokens:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        scores_sorted, token_indices, counts = self.reorderer(top_scores, selected)
        token_indices = token_indices.reshape(-1, 1).expand(-1, dim)
        routed = torch.gather(x, dim=0, index=token_indices)
        if self.score_before_experts:
            routed = (routed.to(torch.float32) * scores_sorted.reshape(-1, 1)).to(x.dtype)
        routed_out = self.experts(routed, counts)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if not self.score_before_experts:
            routed_out = (routed_out.to(torch.float32) * scores_sorted.reshape(-1, 1)).to(x.dtype)
        out = out.scatter_add(dim=0, index=token_indices, src=routed_out)
        return out.reshape(bs, slen, dim)


# --------------------------------------------------------------------------------------------------
# Megatron-Core's layout
# --------------------------------------------------------------------------------------------------

class ExpertMLP(nn.Module):
    """One expert: fc1 to twice the width (gate and up, gated linear unit), fc2 back; returns
    (output, bias) as Megatron's MLP does."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.linear_fc2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up), None


class SequentialMLP(nn.Module):
    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList([ExpertMLP(hidden, ffn_hidden) for _ in range(num_local_experts)])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        outputs = []
        for expert, tokens in zip(self.local_experts, tokens_list):
            output, _ = expert(tokens)
            outputs.append(output)
        return torch.cat(outputs, dim=0), None


class GroupedMLP(nn.Module):
    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.weight1 = nn.Parameter(torch.randn(num_local_experts, hidden, 2 * ffn_hidden) * 0.2)
        self.weight2 = nn.Parameter(torch.randn(num_local_experts, ffn_hidden, hidden) * 0.2)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        sizes = tokens_per_expert.tolist()
        outputs = []
        for e, (tokens, probs) in enumerate(zip(torch.split(permuted_local_hidden_states, sizes),
                                                torch.split(permuted_probs, sizes))):
            gate, up = torch.chunk(tokens @ self.weight1[e], 2, dim=-1)
            intermediate = F.silu(gate) * up * probs.unsqueeze(-1)
            outputs.append(intermediate @ self.weight2[e])
        return torch.cat(outputs, dim=0), None


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, topk: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.normal_(self.weight, std=0.2)
        self.topk = topk

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_indices = torch.topk(scores, k=self.topk, dim=1)
        probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return probs, routing_map


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int):
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    torch._check(sorted_indices.shape[0] == num_out_tokens)  # every token routed to exactly topk experts
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    _, hidden = restore_shape
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    torch._check(permuted_probs.shape[0] == num_out_tokens)
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output = torch.zeros(restore_shape, device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    return output.scatter_add(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)


class MegatronMoE(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int = 4, topk: int = 2, grouped: bool = False):
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, topk)
        self.grouped = grouped
        self.experts = (GroupedMLP if grouped else SequentialMLP)(num_experts, hidden, ffn_hidden)
        self.topk = topk

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(hidden_states)
        tokens_per_expert = routing_map.sum(dim=0).long()
        routed = hidden_states.shape[0] * self.topk
        permuted, sorted_indices = permute(hidden_states, routing_map, routed)
        if self.grouped:  # the probabilities travel with the rows and are applied inside the experts
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
            torch._check(permuted_probs.shape[0] == routed)
            expert_output, _ = self.experts(permuted, tokens_per_expert, permuted_probs)
            output = torch.zeros_like(hidden_states).scatter_add(
                0, sorted_indices.unsqueeze(1).expand(-1, shape[-1]), expert_output)
        else:
            expert_output, _ = self.experts(permuted, tokens_per_expert)
            output = unpermute(expert_output, sorted_indices, hidden_states.shape, probs, routing_map, routed)
        return output.reshape(shape)


# --------------------------------------------------------------------------------------------------
# Small language models around them
# --------------------------------------------------------------------------------------------------

class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, moe: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.heads = heads
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + self.wo(o.transpose(1, 2).reshape(b, s, d))
        return h + self.moe(self.ffn_norm(h))


class MoELM(nn.Module):
    def __init__(self, make_moe, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([MoEBlock(dim, heads, make_moe()) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


VOCAB, BATCH, SEQ = 64, 4, 8


def _batch() -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"tokens": ids, "labels": torch.roll(ids, -1, 1)}


def titan_moe_lm(use_grouped_mm: bool = False, experts: int = 4, **moe):
    """torchtitan-style MoE language model and its batch (4 rows of 8 tokens)."""
    model = MoELM(lambda: TitanMoE(32, 24, num_experts=experts, use_grouped_mm=use_grouped_mm, **moe), VOCAB)
    return model, _batch()


def megatron_moe_lm(experts: int = 4, grouped: bool = False):
    """Megatron-style MoE language model and its batch."""
    model = MoELM(lambda: MegatronMoE(32, 24, num_experts=experts, grouped=grouped), VOCAB)
    return model, _batch()
