"""The built-in strategies, checked at the plan level (single process, no communication).

The tensor-parallel checks are the Megatron layout read back from the plan: every matmul with a
weight is column- or row-parallel, attention is split by heads, norms run whole, the vocabulary
is split in the embedding and the loss, and the only activations summed across the unit are the
two per transformer layer (after the attention output projection and after the MLP) plus the
embedding's. `partial_to_whole` reads that from the plan and the rules, independently of how the
strategy reached its choices.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable

import pytest
import torch

from nnscaler_plugins import PlanBuilder, op_assign, op_trans
from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.capture.tracing import capture
from nnscaler_plugins.plan.plan import Plan

try:
    import models
except ImportError:  # tests/models.py not written yet: the same small configurations, built here
    import types

    def _lm(config_cls, model_cls, **cfg):
        def build():
            import transformers
            model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
            ids = torch.randint(0, cfg["vocab_size"], (2, 16))
            return model, {"input_ids": ids, "labels": ids}
        return build

    class _MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)}

    def _vit():
        from transformers import ViTConfig, ViTForImageClassification
        model = ViTForImageClassification(ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                    num_attention_heads=4, image_size=32, patch_size=8,
                                                    num_labels=10))
        return model, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))}

    models = types.SimpleNamespace(
        mlp=lambda: (_MLP(), {"x": torch.randn(8, 32), "y": torch.randn(8, 32)}),
        gpt2_small=_lm("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                       n_positions=32, bos_token_id=0, eos_token_id=0),
        llama_small=_lm("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2, hidden_size=64,
                        intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                        max_position_embeddings=32),
        bert_small=_lm("BertConfig", "BertForMaskedLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, vocab_size=128, max_position_embeddings=32),
        vit_small=_vit)
from nnscaler_plugins.strategies import (
    DP,
    HYBRID,
    TP,
    Strategy,
    nnscaler_register_strategies,
)
from nnscaler_plugins.passes.tensor_parallel import (
    matmul_roles,
    partial_to_whole,
    supports_blocked_splits,
)

_GRAPHS: dict[str, tuple[Graph, Any]] = {}


def graph_of(name: str) -> Graph:
    """Capture each model once per session: capture dominates this file's run time."""
    if name not in _GRAPHS:
        torch.manual_seed(0)
        model, inputs = getattr(models, name)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _GRAPHS[name] = (capture(model, (), inputs), model)
    return _GRAPHS[name][0]


def config_of(name: str) -> Any:
    graph_of(name)
    return getattr(_GRAPHS[name][1], "config", None)


def make_plan(name: str, strategy: Callable, unit_size: int, dp: int = 1, **options: Any) -> tuple[PlanBuilder, Plan]:
    b = PlanBuilder(graph_of(name), unit_size=unit_size, dp=dp)
    strategy(b, **options)
    return b, b.finish()


def ops_named(b: PlanBuilder, *names: str) -> list:
    """Ops whose aten packet is one of `names` ("linear", "layer_norm", ...)."""
    return [op for op in b.ops if packet(op) in names]


def packet(op) -> str:
    """'aten.linear.default' -> 'linear'."""
    parts = op.node.op_name.split(".")
    return parts[1] if len(parts) > 2 else parts[0]


def split_labels(plan: Plan, op) -> set[str]:
    return {l for l, _ in plan.ops[op.name].splits}


def layer_count(name: str) -> int:
    cfg = config_of(name)
    return getattr(cfg, "n_layer", None) or getattr(cfg, "num_hidden_layers")


# -- registration --------------------------------------------------------------------------------------
def test_registered_through_the_hook():
    table = nnscaler_register_strategies()
    assert set(table) == {"dp", "tp", "hybrid", "coshard", "gpipe", "1f1b", "interleaved", "zero-bubble", "pipeline", "interlaced", "megatron", "auto",
                          "zero1", "zero2", "zero3", "cp", "ep"}
    assert all(isinstance(s, Strategy) and callable(s.degrees) for s in table.values())


def test_degrees():
    assert DP.degrees(8) == (1, 8)
    assert TP.degrees(8) == (8, 1)
    assert TP.degrees(8, tp=2) == (2, 4)
    assert HYBRID.degrees(8, tp=2, dp=4) == (2, 4)
    assert HYBRID.degrees(8, tp=4) == (4, 2)
    assert HYBRID.degrees(8, dp=2) == (4, 2)
    from nnscaler_plugins import PlanError
    with pytest.raises(PlanError, match="world size"):
        HYBRID.degrees(8, tp=3)
    with pytest.raises(PlanError, match="tp= and/or dp="):
        HYBRID.degrees(8)
    with pytest.raises(PlanError):
        DP.degrees(8, tp=2)


# -- dp and hybrid ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "gpt2_small"])
def test_dp_replicates_everything_on_one_device(name):
    _, plan = make_plan(name, DP, unit_size=1, dp=4)
    assert plan.world_size == 4
    assert all(p.splits == [] and p.devices == [0] for p in plan.ops.values())


@pytest.mark.parametrize("name", ["mlp", "gpt2_small", "llama_small"])
def test_hybrid_is_the_tp_unit_replicated(name):
    _, tp_plan = make_plan(name, TP, unit_size=2)
    _, plan = make_plan(name, HYBRID, unit_size=2, dp=2, tp=2)
    assert (plan.unit_size, plan.dp, plan.world_size) == (2, 2, 4)
    assert {k: v.to_json() for k, v in plan.ops.items()} == {k: v.to_json() for k, v in tp_plan.ops.items()}


# -- tp on transformers ----------------------------------------------------------------------------------------
TRANSFORMERS = [("gpt2_small", 2), ("gpt2_small", 4), ("llama_small", 2), ("llama_small", 4)]


@pytest.mark.parametrize("name,tp", TRANSFORMERS)
def test_tp_splits_every_weight_matmul(name, tp):
    b, plan = make_plan(name, TP, unit_size=tp)
    roles = matmul_roles(b, plan)
    assert roles, "no matmul with a weight parameter found: the matmul rules are missing"
    layers = layer_count(name)
    counts = Counter(roles.values())
    # GPT-2's fused QKV projection needs a blocked column split; a core that cannot record one
    # keeps that matmul whole (attention itself still splits by heads, from the `split` onwards).
    fused = layers if name == "gpt2_small" and not supports_blocked_splits(b) else 0
    assert counts["replicated"] == fused and counts["other"] == 0, roles
    # Per layer the attention output and the MLP down projection are the row-parallel ones.
    assert counts["row"] == 2 * layers, counts
    assert counts["column"] == len(roles) - 2 * layers - fused


@pytest.mark.parametrize("name,tp", TRANSFORMERS)
def test_tp_attention_by_heads_norms_whole(name, tp):
    b, plan = make_plan(name, TP, unit_size=tp)
    sdpa = ops_named(b, "scaled_dot_product_attention")
    assert len(sdpa) == layer_count(name)
    for op in sdpa:
        heads = op.signature.inputs[0][1]
        assert split_labels(plan, op) == {heads}, (op.where(), plan.ops[op.name].splits)
    norms = ops_named(b, "layer_norm", "native_layer_norm", "mean", "rms_norm")
    assert norms
    for op in norms:
        assert not plan.ops[op.name].splits, op.where()


@pytest.mark.parametrize("name,tp", TRANSFORMERS)
def test_tp_vocabulary_parallel_embedding_and_loss(name, tp):
    b, plan = make_plan(name, TP, unit_size=tp)
    g = b.graph
    emb = max(ops_named(b, "embedding"), key=lambda op: g.meta(op.node.inputs[0]).numel)
    assert split_labels(plan, emb) == {emb.signature.inputs[0][0]}
    ce = ops_named(b, "cross_entropy_loss")
    assert len(ce) == 1
    assert split_labels(plan, ce[0]) == {ce[0].signature.inputs[0][1]}


@pytest.mark.parametrize("name,tp", TRANSFORMERS)
def test_tp_two_sums_per_layer(name, tp):
    b, plan = make_plan(name, TP, unit_size=tp)
    sums = partial_to_whole(b.graph, plan)
    assert len(sums) == 2 * layer_count(name) + 1, sums


def test_tied_weight_split_the_same_way_by_both_users():
    b, plan = make_plan("gpt2_small", TP, unit_size=2)
    g = b.graph
    used = {v for op in g.ops for v in op.inputs}
    tied = [v.name for v in g.values.values() if v.kind == "param" and v.aliases and v.name in used]
    assert tied, "gpt2_small should tie its embedding and LM head"
    for name in tied:
        dims = set()
        for op in b.ops:
            for i, v in enumerate(op.node.inputs):
                if v == name:
                    labels = op.signature.inputs[i]
                    dims |= {labels.index(l) for l in split_labels(plan, op) if labels and l in labels}
        assert dims == {0}, dims


@pytest.mark.parametrize("name", ["bert_small", "vit_small", "mlp"])
def test_tp_plans_other_models(name):
    b, plan = make_plan(name, TP, unit_size=2)
    assert plan.unit_size == 2 and len(plan.ops) == len(b.graph.ops)
    if name == "mlp":
        roles = matmul_roles(b, plan)
        assert sorted(roles.values()).count("replicated") == 0, roles


def test_tp_of_one_device_replicates():
    _, plan = make_plan("gpt2_small", TP, unit_size=1)
    assert all(not p.splits for p in plan.ops.values())


# -- a user-written strategy ----------------------------------------------------------------------------------
def mlp_linears_only(builder: PlanBuilder, **_: Any) -> None:
    """What a user writes by hand: the first linear split by output features, the second by input
    features (its weight is [out, in], so dims (1, 0) and (1, 1)), everything else whole."""
    n = builder.unit_size
    linears = [op for op in builder.ops if op.node.op_name.startswith("aten.linear")]
    dims = {linears[0].name: (1, 0), linears[1].name: (1, 1)}
    for op in builder.ops:
        if op.name in dims:
            for device, sub in enumerate(op_trans(op, dim=dims[op.name], num=n)):
                op_assign(sub, device)
        else:
            builder.replicate(op)


def test_user_callable_strategy():
    b, plan = make_plan("mlp", mlp_linears_only, unit_size=2)
    roles = matmul_roles(b, plan)
    assert list(roles.values()) == ["column", "row", "replicated"]  # fc1, fc2, then the head kept whole
    assert all(not plan.ops[n].splits for n in plan.ops if n not in roles)
    assert len(partial_to_whole(b.graph, plan)) == 1


# -- a model no rule or strategy was written for ------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _ResidualMLP(torch.nn.Module):
    def __init__(self, d: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(depth))
        self.head = torch.nn.Linear(d, 8)

    def forward(self, x, y):
        for blk in self.blocks:
            x = blk(x)
        return torch.nn.functional.cross_entropy(self.head(x), y)


def test_tp_on_an_unseen_residual_model():
    g = capture(_ResidualMLP(), (), {"x": torch.randn(4, 32), "y": torch.randint(0, 8, (4,))})
    b = PlanBuilder(g, unit_size=2)
    TP(b)
    plan = b.finish()
    roles = Counter(matmul_roles(b, plan).values())
    assert roles == Counter(column=4, row=3), roles
    assert len(partial_to_whole(g, plan)) == 3


# -- through nns.plan -------------------------------------------------------------------------------------------
def test_plan_by_name_and_by_callable():
    import nnscaler_plugins as nns
    from nnscaler_plugins.plugins import strategies

    assert {"dp", "tp", "hybrid"} <= set(strategies())
    g = graph_of("mlp")
    assert (nns.plan(g, strategy="dp", world_size=4).dp, nns.plan(g, strategy="tp", world_size=4).unit_size) == (4, 4)
    hybrid = nns.plan(g, strategy="hybrid", world_size=4, tp=2)
    assert (hybrid.unit_size, hybrid.dp) == (2, 2)
    custom = nns.plan(g, strategy=mlp_linears_only, world_size=2)
    assert list(matmul_roles(PlanBuilder(g, unit_size=2), custom).values()) == ["column", "row", "replicated"]
