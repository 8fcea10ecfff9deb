"""Grouped-query attention reads its key/value heads in place (lower/grouped_query.py).

Traced Hugging Face models repeat each key/value head for its query heads before attention; once
the mask is folded into `is_causal`, each device's program calls attention with `enable_gqa=True`
on the heads it holds instead, under any split of the heads, and still computes what eager PyTorch
computes. A call with a mask tensor keeps its repeats.
"""
from __future__ import annotations

import copy

import torch

import models
import nnscaler_plugins as nns


def _attention_lines(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if "aten.scaled_dot_product_attention.default(" in line]


def test_each_rank_attends_with_enable_gqa_and_no_copies_under_dp_and_tp():
    model, batch = models.llama_small()
    for plan, world in (("dp", 1), ("tp", 2), ("tp", 4)):
        compiled = nns.compile(model, batch, plan, world_size=world, cache_dir="/tmp/nns_test_cache")
        for device in range(world):
            source = compiled.artifact(device).source()
            calls = _attention_lines(source)
            assert calls and all("enable_gqa=True" in c for c in calls), (plan, world, calls)
            assert "aten.expand.default" not in source, (plan, world)


def test_training_steps_equal_eager_with_the_heads_read_in_place():
    torch.manual_seed(0)
    eager, batch = models.llama_small()
    eager.train()
    ours = nns.parallelize(copy.deepcopy(eager), batch, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    assert all("enable_gqa=True" in c for c in _attention_lines(ours.generated_source()))
    want = eager(**batch).loss
    want.backward()
    got = ours.train_step(batch)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in eager.named_parameters()}
    compared = 0
    for n, p in ours.named_parameters():
        ref = grads.get(n.split(".", 1)[-1].replace("__", "."))
        if ref is not None:
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
            compared += 1
    assert compared == len(grads)


def test_a_masked_call_keeps_its_repeats():
    model, batch = models.llama_small()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -3:] = 0  # padding: the mask is a tensor the attention reads
    compiled = nns.compile(model, dict(batch, attention_mask=mask), "dp", world_size=1,
                           cache_dir="/tmp/nns_test_cache")
    source = compiled.artifact(0).source()
    assert not any("enable_gqa=True" in c for c in _attention_lines(source))
    assert "aten.expand.default" in source


def test_the_search_prices_what_the_rewrite_leaves():
    """The simulator prices the repeats the program no longer runs as views: the attention keeps
    the un-repeated keys and values for its backward, and the repeats cost nothing; a masked call's
    repeats stay copies, priced as such. Priced activations shrink by exactly the copies."""
    from nnscaler_plugins.lower.grouped_query import graph_repeats
    from nnscaler_plugins.search.opcost import OpCosts

    model, batch = models.llama_small()
    for masked in (False, True):
        inputs = dict(batch)
        if masked:
            inputs["attention_mask"] = torch.ones_like(batch["input_ids"])
            inputs["attention_mask"][0, -3:] = 0
        graph = nns.capture(model, inputs)
        costs = OpCosts.of(graph)
        repeats = graph_repeats(graph)
        attention = [op for op in graph.ops if op.short_name == "scaled_dot_product_attention"]
        assert attention and bool(repeats) != masked, (masked, repeats)
        for op in attention:
            q, k, v = op.inputs[:3]
            kept = [graph.meta(costs.storage(x)).numel for x in (k, v)]
            heads = graph.meta(q).shape[1] // (1 if masked else model.config.num_attention_heads
                                               // model.config.num_key_value_heads)
            assert kept == [graph.meta(q).numel * heads // graph.meta(q).shape[1]] * 2, (masked, kept)
        for name in repeats:
            assert costs.ops[name].kind == "view", (name, costs.ops[name].kind)
