"""Searching for the lengths a job sees: one representative length or a histogram of them, and
plans that run at lengths they were not priced at."""
from __future__ import annotations

import pytest
import torch

import models


def test_histogram_and_resizing():
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.search.lengths import MAX_BINS, at_length, histogram, representative

    assert histogram(128) == [(128, 1.0)]
    assert histogram([64, 64, 128, 256]) == [(64, 0.5), (128, 0.25), (256, 0.25)]
    assert representative(histogram({100: 3, 200: 1})) == 125
    many = histogram(list(range(1, 101)))
    assert len(many) <= MAX_BINS and abs(sum(w for _, w in many) - 1) < 1e-9
    with pytest.raises(PlanError, match="lengths="):
        histogram({0: 1})
    batch = {"input_ids": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4), "x": torch.ones(2, 4)}
    longer = at_length(batch, 10)
    assert longer["input_ids"].shape == (2, 10) and longer["labels"].shape == (2, 10)
    assert longer["x"].shape == (2, 4)  # float inputs are not taken for tokens
    assert at_length(batch, 3)["input_ids"].tolist() == [[0, 1, 2], [4, 5, 6]]


def test_search_over_a_length_histogram_prices_mean_time_and_longest_memory():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.gpt2_small()
    hist = {8: 3, 16: 1, 32: 1}
    result = nns.search(model, world_size=4, example_inputs=batch, cluster="a100-dgx", lengths=hist, progress=False)
    assert any("priced over lengths [8, 16, 32]" in n for n in result.notes)
    for est in result.estimates:
        per = est.details["lengths"]
        assert sorted(per) == [8, 16, 32]
        mean = sum(p["weight"] * p["step_time_s"] for p in per.values())
        assert est.step_time_s == pytest.approx(mean)
        assert est.max_memory_bytes == pytest.approx(max(p["max_memory_bytes"] for p in per.values()))
        assert per[32]["max_memory_bytes"] > per[8]["max_memory_bytes"]  # activations grow with the length


def run_at_other_length(rank: int, world: int) -> float:
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss
    from nnscaler_plugins.search.lengths import at_length

    torch.manual_seed(0)
    model, batch = models.gpt2_small()
    ref, _ = models.gpt2_small()
    ref.load_state_dict(model.state_dict())
    model.eval()
    ref.eval()
    plan = nns.plan(model, strategy="megatron", world_size=world, tp=2, sequence_parallel=True,
                    example_inputs=at_length(batch, 8))  # made at length 8, given a batch of 16
    pm = nns.parallelize(model, batch, plan=plan, cache_dir="/tmp/nns_test_cache")
    loss = pm.train_step(batch)
    return abs(loss.item() - extract_loss(ref(**batch)).item()) / extract_loss(ref(**batch)).item()


def test_a_plan_made_at_one_length_runs_at_another(workers2):
    assert max(workers2.run(run_at_other_length)) < 1e-5
