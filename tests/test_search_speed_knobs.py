"""compile and fp8 in the cost model and the search's space.

compile=True is priced as kernels COMPILE_SPEEDUP faster (torchtitan's Llama-3.1-8B eager -> compile
tokens/s) on clusters with a GPU kernel table; fp8 prices the converted linears at the cluster's
fp8 peak plus their casts. The search puts them in its space where the preset supports them
(compile=None, fp8=True) and `auto` may choose them (choose_compile, choose_fp8).
"""
from __future__ import annotations

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.search.costmodel import COMPILE_SPEEDUP


@pytest.fixture(scope="module")
def llama_8b_layer():
    """One Llama-3-8B layer at sequence 8192 (meta weights): float8 pays at these sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=32000, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    return nns.capture(model, kwargs={"input_ids": ids, "labels": ids})


def _step(graph, cluster, **options) -> float:
    return nns.simulate(nns.plan(graph, strategy="dp", world_size=1, **options), cluster).step_time_s


def test_compile_and_fp8_are_priced_where_the_cluster_has_them(llama_8b_layer):
    h100, a100 = nns.cluster("h100-dgx"), nns.cluster("a100-dgx")
    eager = _step(llama_8b_layer, h100, precision="bf16")
    compiled = _step(llama_8b_layer, h100, precision="bf16", compile=True)
    # the kernels' time shrinks by COMPILE_SPEEDUP; the optimizer step (not compiled) stays
    assert 1.08 < eager / compiled <= COMPILE_SPEEDUP + 1e-9
    fp8 = _step(llama_8b_layer, h100, precision="fp8", compile=True)
    assert fp8 < 0.9 * compiled  # torchtitan: 8,532 vs 6,667 tokens/s
    # an A100 has no float8 units: its fp8 plan is priced as bf16 plus nothing
    assert _step(llama_8b_layer, a100, precision="fp8") == pytest.approx(_step(llama_8b_layer, a100, precision="bf16"))
    # the local CPU preset measures eager PyTorch: no discount
    cpu = nns.cluster("local-cpu", devices=1, measure=False)
    assert _step(llama_8b_layer, cpu, compile=True) == pytest.approx(_step(llama_8b_layer, cpu))


def test_search_and_auto_choose_compile_and_fp8_where_supported(llama_8b_layer):
    found = nns.search(llama_8b_layer, world_size=1, cluster="h100-dgx", precision="bf16", compile=None, fp8=True,
                       progress=False)
    assert found.best.knobs.compile and found.best.precision == "fp8"
    on_a100 = nns.search(llama_8b_layer, world_size=1, cluster="a100-dgx", precision="bf16", compile=None, fp8=True,
                         progress=False)
    assert on_a100.best.knobs.compile and on_a100.best.precision == "bf16"
    plain = nns.search(llama_8b_layer, world_size=1, cluster="h100-dgx", precision="bf16", progress=False)
    assert not plain.best.knobs.compile and plain.best.precision == "bf16"  # opt-in: nothing changes by default
    plan = nns.plan(llama_8b_layer, strategy="auto", world_size=1, cluster="h100-dgx", choose_compile=True,
                    choose_fp8=True)
    assert plan.knobs.compile and plan.precision == "fp8"
    assert nns.simulate(plan, nns.cluster("h100-dgx")).step_time_s < 0.8 * plain.estimates[0].step_time_s
