"""Pictures read at a glance: no text leaves the frame or lies on other text, for a data-parallel
plan, a pipeline plan and a pipeline of 512 micro-batches (folded), and the Pareto curve numbers
and words its plans as `ParetoSet.table()` does."""
from __future__ import annotations

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.render import (
    fmt_bytes,
    fmt_seconds,
    nice_ticks,
    plan_label,
    render_device_map,
    render_pareto,
    render_timeline,
    svg_text_boxes,
)


@pytest.fixture(scope="module")
def graphs():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    out = {}
    for batch in (1, 8):
        ids = torch.zeros(batch, 16, dtype=torch.long)
        out[batch] = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    return out


@pytest.fixture(scope="module")
def cpu():
    return nns.cluster("local-cpu", devices=8, measure=False)


def assert_readable(svg: str) -> None:
    (width, height), boxes = svg_text_boxes(svg)
    assert boxes and width > 0 and height > 0
    for text, (x0, y0, x1, y1) in boxes:
        assert x0 >= 0 and y0 >= 0 and x1 <= width and y1 <= height, f"{text!r} leaves the {width}x{height} frame"
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            apart = ba[2] <= bb[0] or bb[2] <= ba[0] or ba[3] <= bb[1] or bb[3] <= ba[1]
            assert apart, f"{a!r} overlaps {b!r}"


def test_numbers_and_words():
    assert [fmt_seconds(x) for x in (0, 7.62e-5, 0.0879, 1.857e4)] == ["0", "76.2 µs", "87.9 ms", "310 min"]
    assert [fmt_bytes(x) for x in (0, 8.18e6, 40 * 2 ** 30)] == ["0", "7.8 MiB", "40 GiB"]
    assert nice_ticks(0.0879 * 1.1) == [0, 0.02, 0.04, 0.06, 0.08, 0.1]


def test_dp_plan_device_map_shows_every_replica(graphs, tmp_path):
    plan = nns.plan(graphs[8], strategy="dp", world_size=4)
    svg = render_device_map(plan, tmp_path / "dp.svg", graphs[8], title="dp")
    assert_readable(svg)
    assert [f"dev {d}" for d in range(4)] == [t.split(" (")[0] for t, _ in svg_text_boxes(svg)[1]
                                              if t.startswith("dev ")]
    assert "dp 4, no ZeRO, no recompute" in svg


def test_pipeline_plan_map_and_timeline_with_sync_and_optimizer(graphs, cpu, tmp_path):
    plan = nns.plan(graphs[8], strategy="1f1b", world_size=8, pp=2, tp=2, dp=2, micro_batches=4)
    assert plan_label(plan) == "tp 2 x pp 2 x dp 2, 1F1B, 4 micro-batches, no ZeRO, no recompute"
    assert_readable(render_device_map(plan, None, graphs[8], title="a long title " * 8))
    est = nns.simulate(plan, cpu, keep_timeline=True)
    svg = render_timeline(est.timeline, None, title="1F1B " * 30, estimate=est)
    assert_readable(svg)
    assert "optimizer step" in svg and f"step {fmt_seconds(est.step_time_s)}" in svg


def test_512_micro_batches_are_folded(graphs, cpu):
    plan = nns.plan(graphs[1], strategy="1f1b", world_size=4, pp=4, micro_batches=512)
    est = nns.simulate(plan, cpu, keep_timeline=True)
    svg = render_timeline(est.timeline, None, title="512 micro-batches", estimate=est)
    assert_readable(svg)
    assert "folded" in svg and "busy" in svg
    assert svg.count("<rect") < 200  # not 4096 hairlines
    assert_readable(render_timeline(plan.timeline(per_device=True), None, row_label="device", unit="task"))


def test_pareto_numbers_plans_as_the_table_and_draws_the_limit(graphs, cpu):
    plans = nns.search(graphs[8], world_size=4, cluster=nns.cluster("local-cpu", devices=4, measure=False),
                       progress=False)
    table = plans.table().splitlines()[1:]
    svg = render_pareto(plans, None, title="tiny GPT-2", memory_limit=plans.estimates[0].max_memory_bytes * 1.2)
    assert_readable(svg)
    texts = [t for t, _ in svg_text_boxes(svg)[1]]
    for i, (row, plan) in enumerate(zip(table, plans)):
        assert row.split()[0] == f"#{i}" and row.endswith(plan_label(plan))
        assert plan_label(plan) in " ".join(texts)
    assert any(t.startswith("memory limit") for t in texts)
    far = render_pareto(plans, None, memory_limit=80 * 2 ** 30)
    assert "far above every plan" in far and "step time (ms)" in far


def test_labels_of_context_and_expert_parallel_plans():
    """A cp plan without tp= splits the sequence over its group (not "tp"); the ep strategy's dense
    part is batch-split in its unit, and its experts split ep (and etp) ways."""
    from test_context_parallel import causal_lm
    from test_expert_parallel import mixtral

    model, batch = causal_lm(seq=16, kv_heads=2, heads=4)
    assert plan_label(nns.plan(model, strategy="cp", world_size=2, cp=2, example_inputs=batch)) \
        == "cp 2 (ring), no ZeRO, no recompute"
    torch.manual_seed(0)
    model, batch = mixtral()
    assert plan_label(nns.plan(model, strategy="ep", world_size=4, ep=2, etp=2, example_inputs=batch)) == \
        "dp 4, experts split 2 ways (ep 2), each expert's width 2 ways (etp 2), no ZeRO, no recompute"
