"""Offload as a plan knob: offload="optimizer" (optimizer state and step in host memory) and
offload="params" (ZeRO-3 parameter chunks there too) train exactly as the same plan without
offload (2 gloo processes, AdamW, fp32 and bf16), a sharded checkpoint of an offloaded run loads
into the plan without it and its export streams the same weights, bad values are refused by name before anything starts, and the simulator
prices the offloaded plan: less device memory by the bytes moved to the host, more time for the
host-device traffic.
"""
from __future__ import annotations

import os

import models
import pytest
import torch

CASES = [  # (strategy, options): ZeRO-2's chunked masters, ZeRO-3 chunks on the host with bf16 masters
    ("dp", {"zero": 2, "offload": "optimizer"}),
    ("zero3", {"offload": "params", "precision": "bf16"}),
]
if os.environ.get("NNS_TEST_ALL_PLANS"):  # whole-tensor masters (tp), fp32 chunks that are their own masters
    CASES += [("tp", {"offload": "optimizer"}), ("zero3", {"offload": "optimizer"}), ("zero3", {"offload": "params"})]


def _batch(step: int, replica: int, dp: int) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, models.VOCAB, (models.BATCH, models.SEQ), generator=g)
    n = models.BATCH // dp
    return {"input_ids": ids[replica * n:(replica + 1) * n], "labels": ids[replica * n:(replica + 1) * n].clone()}


def _run(rank: int, world: int, strategy: str, options: dict, steps: int, root: str, reload: bool = False):
    """Train `steps` AdamW steps under a plan; with `root` save a checkpoint and export the model
    there, with `reload` train one step more and load that checkpoint back."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, _ = models.gpt2_small(1)
    model.eval()
    pm = nns.parallelize(model, _batch(0, 0, 1 if strategy == "tp" else world), plan=strategy, world_size=world,
                         cache_dir="/tmp/nns_test_cache", **options)
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def step(i: int) -> torch.Tensor:
        loss = pm.train_step(_batch(i, pm.dp_rank, pm.dp_size)).detach().clone()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss
    losses = [step(i) for i in range(steps)]
    where = {"masters": sorted({str(e.master.device) for e in opt.entries}),
             "copies": all(e.master is not e.param for e in opt.entries),
             "chunks_host": None if pm.zero3 is None else all(c.device.type == "cpu" for c in pm.zero3.chunks)}
    out = [losses, pm.full_state_dict(), opt.full_state_dict(), where]
    if not reload:
        nns.checkpoint.save(os.path.join(root, "offloaded"), pm, opt, step=steps)
        nns.checkpoint.export(os.path.join(root, "exported.pt"), pm)  # streamed tensor by tensor to rank 0
    else:  # the offloaded run's checkpoint, loaded by this run without offload after it moved on
        step(steps)
        nns.checkpoint.load(os.path.join(root, "offloaded"), pm, opt)
        out.append((pm.full_state_dict(), opt.full_state_dict()))
    return out


def both(rank: int, world: int, strategy: str, options: dict, root: str) -> list:
    plain = {k: v for k, v in options.items() if k != "offload"}
    return [_run(rank, world, strategy, options, 3, root), _run(rank, world, strategy, plain, 3, root, reload=True)]


def test_offloaded_runs_equal_the_runs_without_offload_exactly(workers2, tmp_path):
    for strategy, options in CASES:
        root = str(tmp_path / f"{strategy}_{'_'.join(f'{k}{v}' for k, v in options.items())}")
        os.makedirs(root)
        (off, off_model, off_opt, where), (ref, ref_model, ref_opt, _, (loaded_model, loaded_opt)) = \
            workers2.run(both, strategy, options, root)[0]
        what = f"{strategy} {options}"
        assert where["masters"] == ["cpu"] and where["copies"] or options["offload"] == "params", (what, where)
        if options["offload"] == "params":
            assert where["chunks_host"], what
        assert all(torch.equal(a, b) for a, b in zip(off, ref)), (what, off, ref)
        for model, opt, how in ((ref_model, ref_opt, "without offload"), (loaded_model, loaded_opt, "loaded")):
            assert set(model) == set(off_model) and all(torch.equal(off_model[k], v) for k, v in model.items()), \
                (what, how)
            assert all(torch.equal(opt["state"][n][k], v) for n, keys in off_opt["state"].items()
                       for k, v in keys.items() if torch.is_tensor(v)), (what, how)
        exported = torch.load(os.path.join(root, "exported.pt"), weights_only=True)
        assert set(exported) == set(off_model) and all(torch.equal(exported[k], v) for k, v in off_model.items())


def test_offload_values_are_checked_by_name():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    model, batch = models.mlp()
    graph = nns.capture(model, kwargs=batch) if isinstance(batch, dict) else nns.capture(model, (batch,))
    with pytest.raises(PlanError, match="offload='nvme' is not supported.*host memory only"):
        nns.plan(graph, strategy="zero3", world_size=2, offload="nvme")
    with pytest.raises(PlanError, match="offload='params' keeps ZeRO-3's parameter chunks.*zero=2"):
        nns.plan(graph, strategy="dp", world_size=2, zero=2, offload="params")
    with pytest.raises(PlanError, match="offload='cpu'"):
        nns.plan(graph, strategy="dp", world_size=2, offload="cpu")
    p = nns.plan(graph, strategy="zero3", world_size=2, offload="params")
    assert p.offload == "params" and type(p).from_json(p.to_json()).offload == "params"
    assert "offloaded to host memory" in p.explain()


def test_simulator_prices_offload():
    import dataclasses

    import nnscaler_plugins as nns
    from nnscaler_plugins.search.offload_cost import offload_price
    from nnscaler_plugins.search.simulator import training_of

    model, batch = models.gpt2_small(1)
    cluster = nns.cluster("a100-dgx", nodes=1)
    base = nns.plan(model, strategy="zero3", world_size=8, example_inputs=batch)
    est = nns.simulate(base, cluster)
    prices = {}
    for offload in ("optimizer", "params"):
        p = dataclasses.replace(base, offload=offload)
        price = offload_price(p, cluster, est.memory, training=training_of(p, cluster), micro_batches=est.micro_batches,
                              device_step_s=est.details["optimizer_s"])
        got = nns.simulate(p, cluster)
        assert price.device_bytes_saved > 0 and price.transfer_s > 0 and price.seconds > 0, offload
        assert got.max_memory_bytes == pytest.approx(est.max_memory_bytes - price.device_bytes_saved, rel=1e-9)
        assert got.step_time_s == pytest.approx(est.step_time_s + price.seconds, rel=1e-9)
        assert got.details["offload"]["device_bytes_saved"] == pytest.approx(price.device_bytes_saved)
        prices[offload] = price
    # the optimizer's states (masters and moments: 12 of every 16 bytes in bf16) move under both; params
    # also move the weights and gradients, and pay an upload per gather instead of one per step
    assert prices["optimizer"].device_bytes_saved == pytest.approx(est.memory["optimizer"])
    assert prices["params"].device_bytes_saved == pytest.approx(
        est.memory["optimizer"] + est.memory["params"] + est.memory["grads"])
    slow = dataclasses.replace(cluster, host_bandwidth=cluster.host_bandwidth / 10)
    opt_plan = dataclasses.replace(base, offload="optimizer")
    assert offload_price(opt_plan, slow, est.memory, training=training_of(opt_plan, slow)).transfer_s == \
        pytest.approx(10 * prices["optimizer"].transfer_s)
