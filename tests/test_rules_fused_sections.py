"""Tensor parallelism through fused projections with unequal sections and through dims merged by a
reshape: the two shapes that kept multi-query/grouped-head and ALiBi decoders from being split.

- A projection whose output is cut into unequal sections (multi-query [q | k | v], grouped heads,
  any [a | b]) is captured as one matmul per section over a slice of its weight
  (capture/fused_sections.py); the parameter stays one parameter.
- A reshape merging (b, h) into b*h carries a split of h as a blocked split of the merged dim
  (`Signature.merged`), so an attention written on (b*h, s, d) runs head-parallel.

Each model is small and trains at world 2 exactly like one process. The default run takes one
case of each mechanism; NNS_TEST_ALL_PLANS=1 adds grouped heads, the other cuts and co-shard.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from sgd_check import sgd_equivalence

B, S, D, HD = 2, 8, 32, 8
EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"


class FusedAttention(torch.nn.Module):
    """Attention over a fused QKV projection of `heads` query and `kv` key/value heads, cut by
    `cut`: "split" (split_with_sizes), "slice" (three slices) or "index" (Falcon's view and
    `t[..., [-2], :]`, for one key/value head); with `matmul`, the projection is written as
    Falcon's linear, `x @ W.T + b`."""

    def __init__(self, heads: int = 4, kv: int = 1, cut: str = "split", bias: bool = True, matmul: bool = False):
        super().__init__()
        self.heads, self.kv, self.cut, self.matmul = heads, kv, cut, matmul
        self.qkv = torch.nn.Linear(D, (heads + 2 * kv) * HD, bias=bias)
        self.out = torch.nn.Linear(heads * HD, D)
        self.up = torch.nn.Linear(D, 2 * D)
        self.down = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        b, s, _ = x.shape
        h, kv = self.heads, self.kv
        if self.matmul:
            y = x @ self.qkv.weight.T
            y = y + self.qkv.bias if self.qkv.bias is not None else y
        else:
            y = self.qkv(x)
        if self.cut == "split":
            q, k, v = y.split([h * HD, kv * HD, kv * HD], dim=-1)
        elif self.cut == "slice":
            q, k, v = y[..., :h * HD], y[..., h * HD:(h + kv) * HD], y[..., (h + kv) * HD:]
        else:
            y = y.view(b, s, h + 2, HD)
            q, k, v = y[..., :-2, :], y[..., [-2], :], y[..., [-1], :]
        q = q.reshape(b, s, h, HD).transpose(1, 2)
        k = k.reshape(b, s, kv, HD).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        v = v.reshape(b, s, kv, HD).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h * HD))
        gate, up = self.up(x).chunk(2, dim=-1)  # equal sections: the blocked split's case
        x = x + self.down(F.silu(gate) * up)
        return {"loss": F.mse_loss(x, labels)}


class FoldedHeadsAttention(torch.nn.Module):
    """BLOOM's shape: batch and heads folded into one dim for an ALiBi baddbmm and a bmm."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(heads)]), persistent=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        b, s, _ = x.shape
        h, d = self.heads, D // self.heads
        y = self.qkv(x).view(b, s, h, 3, d)
        q, k, v = (y[..., i, :].transpose(1, 2).reshape(b * h, s, d) for i in range(3))
        alibi = (self.slopes[None, :, None] * torch.arange(s, dtype=x.dtype)[None, None, :]).expand(b, h, s)
        scores = alibi.reshape(b * h, 1, s).baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=d ** -0.5)
        probs = scores.view(b, h, s, s).softmax(-1).view(b * h, s, s)
        ctx = torch.bmm(probs, v).view(b, h, s, d).permute(0, 2, 1, 3).reshape(b, s, D)
        return {"loss": F.mse_loss(x + self.out(ctx), labels)}


def _builder(cls, **kw):
    def build():
        torch.manual_seed(0)
        model = cls(**kw)
        g = torch.Generator().manual_seed(1)
        return model, {"x": torch.randn(B, S, D, generator=g), "labels": torch.randn(B, S, D, generator=g)}
    return build


def _graph(build):
    from nnscaler_plugins.capture.tracing import capture

    model, batch = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, batch), model


def _transposes(graph, weight: str) -> list[str]:
    return [o for op in graph.ops if op.inputs == [weight] for o in op.outputs if o is not None]


def _tp_fraction(graph) -> float:
    import nnscaler_plugins as nns
    from nnscaler_plugins.passes.tensor_parallel import split_matmul_flops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = nns.plan(graph, strategy="tp", world_size=2)
    done, total = split_matmul_flops(graph, plan)
    return done / total


@pytest.mark.parametrize("cut,matmul", [("split", False), ("slice", False), ("index", False), ("index", True)]
                         if EVERY else [("index", True)])
def test_unequal_sections_become_one_matmul_each_over_one_parameter(cut, matmul):
    graph, model = _graph(_builder(FusedAttention, cut=cut, matmul=matmul))
    weight = graph.parameters["qkv.weight"].name
    sections = [op for op in graph.ops if op.short_name in ("linear", "matmul")
                and any(graph.op(graph.values[i].producer).inputs[0] in (weight, *_transposes(graph, weight))
                        for i in op.inputs[1:2] if graph.values[i].kind == "op")]
    assert len(sections) == 3, [op.name for op in sections]
    widths = sorted(graph.meta(op.outputs[0]).shape[-1] for op in sections)
    assert widths == [HD, HD, 4 * HD]
    assert set(graph.parameters) == {n for n, _ in model.named_parameters()}
    # the [gate | up] chunk of equal sections stays one matmul, split in blocks by the plan
    assert len([op for op in graph.ops if op.module_path == "up" and op.short_name == "linear"]) == 1


def test_sections_that_are_not_contiguous_ranges_stay_fused():
    class Strided(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Linear(D, 3 * D)

        def forward(self, x, labels):
            y = self.p(x)
            return {"loss": F.mse_loss(y[..., ::3] + y[..., 1::3], labels)}

    graph, _ = _graph(_builder(Strided))
    assert len([op for op in graph.ops if op.short_name == "linear"]) == 1


@pytest.mark.parametrize("kv,cut", [(1, "index"), (1, "split"), (2, "slice")] if EVERY else [(1, "index")])
def test_tp_splits_fused_multi_query_and_grouped_projections(kv, cut):
    graph, _ = _graph(_builder(FusedAttention, kv=kv, cut=cut, matmul=cut == "index"))
    assert _tp_fraction(graph) >= 0.9


def test_tp_splits_attention_on_folded_batch_and_heads():
    graph, _ = _graph(_builder(FoldedHeadsAttention))
    import nnscaler_plugins as nns

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = nns.plan(graph, strategy="tp", world_size=2)
    folded = [op for op in graph.ops if op.short_name in ("baddbmm", "bmm")]
    assert len(folded) == 2 and all(plan.ops[op.name].splits for op in folded)
    assert _tp_fraction(graph) == 1.0


def _train(rank, world, cls, kw, strategy):
    return sgd_equivalence(rank, world, _builder(cls, **kw), strategy, {}, dp=world if strategy == "dp" else 1,
                           what=f"{cls.__name__} {kw} {strategy}")


TRAINED = {
    "mqa-index-tp": (FusedAttention, {"kv": 1, "cut": "index", "matmul": True}, "tp"),
    "folded-tp": (FoldedHeadsAttention, {}, "tp"),
    "gqa-slice-tp": (FusedAttention, {"kv": 2, "cut": "slice"}, "tp"),
    "mqa-split-coshard": (FusedAttention, {"kv": 1, "cut": "split", "bias": False}, "coshard"),
    "folded-coshard": (FoldedHeadsAttention, {}, "coshard"),
}
DEFAULT_TRAINED = ("mqa-index-tp", "folded-tp")


@pytest.mark.parametrize("cls,kw,strategy", [v for k, v in TRAINED.items() if EVERY or k in DEFAULT_TRAINED],
                         ids=[k for k in TRAINED if EVERY or k in DEFAULT_TRAINED])
def test_trains_like_one_process(cls, kw, strategy, workers2):
    problems = workers2.run(_train, cls, kw, strategy)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)
