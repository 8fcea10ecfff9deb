"""The simulator replays a plan's own task lists with cost-model durations (timeline.replay)."""
from __future__ import annotations

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.timeline import Timeline
from nnscaler_plugins.search import Estimate

GiB = 1024 ** 3


@pytest.fixture(scope="module")
def graph():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=8, n_embd=1024, n_head=16, vocab_size=4096, n_positions=512, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return nns.capture(model, kwargs={"input_ids": ids, "labels": ids})


@pytest.fixture(scope="module")
def spec():
    return nns.cluster("a100-dgx", nodes=2)


def megatron(graph, world, m, **opts):
    from nnscaler_plugins.plan.primitives import PlanBuilder
    from nnscaler_plugins.plugins import get_strategy

    st = get_strategy("megatron")
    unit, dp = st.degrees(world, **opts)
    b = PlanBuilder(graph, unit, dp, strategy="megatron", micro_batches=m)
    st(b, **{k: v for k, v in opts.items() if k != "zero"})
    plan = b.finish()
    if "zero" in opts:
        plan.zero = opts["zero"]
    return plan


def test_replays_the_plans_task_lists(graph, spec):
    plan = megatron(graph, 4, 8, pp=4, tp=1)
    est = nns.simulate(plan, spec, keep_timeline=True)
    tl = est.timeline
    assert isinstance(tl, Timeline)
    assert sum(len(e) for e in tl.events) == 2 * 8 * 4  # F and B of 8 micro-batches on 4 stages
    assert [[e.task for e in evs] for evs in tl.events] == plan.pipeline.task_lists()
    f, b = est.details["stage_fwd_s"], est.details["stage_bwd_s"]
    ideal = 8 * max(x + y for x, y in zip(f, b))
    assert est.bubble_s > 0 and tl.makespan >= ideal
    # equal middle stages: the 1F1B bubble is about (p - 1) / (m + p - 1) of the step
    assert tl.bubble_fraction() == pytest.approx(3 / 11, abs=0.08)
    assert est.step_time_s >= tl.makespan and est.compute_s > 0


def test_each_stage_names_its_devices_so_one_ranks_peak_can_be_read(graph, spec):
    # a published figure of one rank (a metrics writer on the last rank) is compared with that rank's
    # peak, not the largest: the estimate says which unit devices each pipeline stage runs on
    plan = megatron(graph, 8, 8, pp=4, tp=2, schedule="1f1b")
    est = nns.simulate(plan, spec)
    stages = est.details["stage_devices"]
    assert stages == [list(g) for g in plan.pipeline.stage_devices]
    peak = [max(est.peak_memory_bytes[d] for d in devs) for devs in stages]
    # 1F1B: the first stage keeps p micro-batches in flight, the last one; the last also holds the head
    assert peak[0] == est.max_memory_bytes and peak[-1] < peak[0]
    assert len(est.peak_memory_bytes) == plan.unit_size == sum(len(d) for d in stages)


def test_schedules_and_micro_batches(graph, spec):
    one = [nns.simulate(megatron(graph, 4, m, pp=4, schedule="1f1b"), spec) for m in (4, 16)]
    gp = [nns.simulate(megatron(graph, 4, m, pp=4, schedule="gpipe"), spec) for m in (4, 16)]
    # GPipe holds every micro-batch's activations, 1F1B at most one per stage
    assert 3.5 < gp[1].memory["activations"] / gp[0].memory["activations"] < 4.5
    assert one[1].memory["activations"] == pytest.approx(one[0].memory["activations"], rel=0.05)
    inter = nns.simulate(megatron(graph, 4, 16, pp=4, schedule="interleaved", virtual_stages=2), spec)
    assert inter.bubble_s < one[1].bubble_s  # interleaving shrinks the bubble


def test_zero_and_recompute(graph, spec):
    ests = [nns.simulate(megatron(graph, 8, 4, tp=2, zero=z), spec) for z in range(4)]
    peaks = [e.max_memory_bytes for e in ests]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
    # ZeRO-3 gathers the weights again in every micro-batch's passes (overlapped, they still slow them) and
    # steps the optimizer on its shard only; the step may come out either side of ZeRO-0's
    assert ests[3].details["stage_fwd_s"][0] > ests[0].details["stage_fwd_s"][0]
    assert ests[3].details["optimizer_s"] < ests[0].details["optimizer_s"]
    none = nns.simulate(megatron(graph, 2, 4, tp=2), spec)
    full = nns.simulate(megatron(graph, 2, 4, tp=2, recompute="full"), spec)
    sel = nns.simulate(megatron(graph, 2, 4, tp=2, recompute="selective", sequence_parallel=True), spec)
    assert full.memory["activations"] < sel.memory["activations"] < none.memory["activations"]
    assert full.step_time_s > sel.step_time_s > none.step_time_s * 0.99


def test_graph_needed_and_world_checked(graph, spec, tmp_path):
    plan = megatron(graph, 4, 2, tp=4)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    with pytest.raises(PlanError, match="needs the graph"):
        nns.simulate(loaded, spec)
    assert nns.simulate(loaded, spec, graph).step_time_s == pytest.approx(nns.simulate(plan, spec).step_time_s)
    with pytest.raises(PlanError, match=r"needs 16 devices.*nodes=2"):
        nns.simulate(megatron(graph, 16, 1, tp=8), nns.cluster("v100-p3"))


def test_estimate_round_trip(graph, spec):
    est = nns.simulate(megatron(graph, 4, 4, tp=2, pp=2), spec)
    again = Estimate.from_json(est.to_json())
    assert again.step_time_s == est.step_time_s and again.peak_memory_bytes == est.peak_memory_bytes
    assert len(est.peak_memory_bytes) == 4 and "GiB" in est.describe()


def test_a_stack_with_bf16_gradients_prices_half_the_gradient_bytes(graph, spec):
    """A published run's stack may keep its gradients in bf16 (Megatron-Core with grad_reduce_in_fp32=False):
    the gradients are priced at 2 bytes a parameter there, and nothing else moves."""
    from dataclasses import replace

    plan = megatron(graph, 4, 2, tp=2, zero=1)
    fp32 = nns.simulate(plan, spec)
    bf16 = nns.simulate(plan, replace(spec, efficiency=replace(spec.efficiency, main_grad_bytes=2)))
    assert fp32.details["training"]["grad_bytes"] == 4 and bf16.details["training"]["grad_bytes"] == 2
    assert bf16.memory["grads"] == pytest.approx(fp32.memory["grads"] / 2)
    for key in ("params", "optimizer", "activations"):
        assert bf16.memory[key] == pytest.approx(fp32.memory[key])
    assert type(spec.efficiency).from_json(bf16_json := replace(spec.efficiency, main_grad_bytes=2).to_json()) \
        .main_grad_bytes == 2 and isinstance(bf16_json["main_grad_bytes"], int)


def test_the_optimizer_step_of_a_bf16_gradient_stack_holds_an_fp32_copy_of_its_shards_gradients(graph, spec):
    """Megatron-Core's optimizer copies each bf16 gradient of its shard to fp32 for the update, when the
    activations are gone: with little in flight (full recomputation) that step sets the peak, at the
    states plus 4 bytes per element of the device's optimizer shard. This runtime keeps fp32 gradients:
    its step adds nothing."""
    from dataclasses import replace

    plan = megatron(graph, 4, 2, tp=2, zero=1, recompute="full")
    bf16 = replace(spec, efficiency=replace(spec.efficiency, main_grad_bytes=2))
    est, ours = nns.simulate(plan, bf16), nns.simulate(plan, spec)
    shard = est.memory["optimizer"] / 12  # fp32 master weights and two moments per element
    states = est.memory["params"] + est.memory["grads"] + est.memory["optimizer"] + est.memory["buffers"]
    assert est.memory["optimizer_step"] == pytest.approx(4 * shard)
    assert est.max_memory_bytes == pytest.approx(states + 4 * shard)
    assert est.max_memory_bytes == pytest.approx(sum(est.memory.values()))  # the breakdown adds up
    assert "optimizer_step" not in ours.memory
    assert ours.max_memory_bytes == pytest.approx(sum(ours.memory.values()))
