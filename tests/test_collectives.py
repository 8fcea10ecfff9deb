"""Counting the communication a known plan emits: Megatron-style tp must not add any."""
from __future__ import annotations

import models
import pytest

import nnscaler_plugins as nns
from nnscaler_plugins.lower.lowering import lower


@pytest.mark.parametrize("build", ["gpt2_small", "llama_small"])
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_tp_has_two_activation_allreduces_per_layer(build, tp):
    model, inputs = getattr(models, build)()
    g = nns.capture(model, kwargs=inputs)
    program = lower(g, nns.plan(g, strategy="tp", world_size=tp))
    layers = model.config.num_hidden_layers
    for device in range(tp):
        counts = program.collective_counts(device)
        # Per layer: after the attention output projection and after the MLP down projection.
        # Plus one for the vocabulary-parallel embedding's partial sums. Nothing else is gathered:
        # the loss is computed by the vocabulary-parallel cross-entropy kernel on the split logits.
        assert counts.get("all-reduce", 0) == 2 * layers + 1, counts
        assert counts.get("all-gather", 0) <= 1, counts  # only the logits returned to the caller
        assert not counts.get("all-to-all") and not counts.get("reduce-scatter"), counts
        kernels = {k: v for k, v in counts.items() if k.startswith("kernel:")}
        assert sum(kernels.values()) == 1, kernels  # the loss


def test_dp_plan_has_no_activation_collectives():
    model, inputs = models.gpt2_small()
    g = nns.capture(model, kwargs=inputs)
    program = lower(g, nns.plan(g, strategy="dp", world_size=4))
    assert not program.collective_counts(0)
    assert program.unit_size == 1 and program.plan.dp == 4


def test_sequence_parallel_swaps_each_allreduce_for_reduce_scatter_and_all_gather():
    """Megatron's sequence parallelism: the norms and residual adds split along the sequence, so
    each all-reduce after a row-parallel matmul becomes a reduce-scatter, and the next column-
    parallel matmul all-gathers its input (Llama's RMS norm runs split, statistics included)."""
    model, inputs = models.llama_small()
    g = nns.capture(model, kwargs=inputs)
    program = lower(g, nns.plan(g, strategy="megatron", world_size=2, tp=2, sequence_parallel=True))
    layers = model.config.num_hidden_layers
    for device in range(2):
        counts = program.collective_counts(device)
        assert not counts.get("all-reduce"), counts
        assert counts.get("reduce-scatter", 0) == 2 * layers + 1, counts  # + the vocabulary-parallel embedding
        # before each attention and MLP block, before the LM head, and the logits returned to the caller
        assert counts.get("all-gather", 0) == 2 * layers + 2, counts
