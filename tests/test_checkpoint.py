"""Checkpoints on real gloo processes: resharding across plans and world sizes, bit-exact resume,
atomic replacement under SIGKILL, export and offline merge, and bad input that loses nothing.

One 2-layer GPT-2 (n_embd 64, vocab 128, seq 16) throughout; the saving runs write every
checkpoint the other tests read, so the expensive parts (capture, planning) happen few times.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import models
from harness import Workers

PLANS = {  # name: (strategy, options, data-parallel degree)
    "tp4": ("tp", {}, 1),
    "pp2tp2": ("1f1b", {"pp": 2, "tp": 2, "micro_batches": 2}, 1),
    "zero3": ("zero3", {}, 4),
    "dp2": ("dp", {}, 2),
    "zero1": ("zero1", {}, 2),
    "single": ("dp", {}, 1),
}


def _batch(step: int) -> dict:
    """The global batch of a step: the same in every run, so a resumed run sees what the original saw."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, models.VOCAB, (models.BATCH, models.SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _replica(batch: dict, replica: int, dp: int) -> dict:
    n = models.BATCH // dp
    return {k: v[replica * n:(replica + 1) * n] for k, v in batch.items()}


def _build(rank: int, world: int, plan_name: str, seed: int = 0):
    """A ParallelModule of the test GPT-2 under a named plan, with AdamW and a step LR schedule."""
    import nnscaler_plugins as nns

    strategy, options, dp = PLANS[plan_name]
    torch.manual_seed(seed)
    model, _ = models.gpt2_small(2)
    model.eval()  # no dropout: the trajectory depends on the weights and batches alone
    example = _replica(_batch(0), 0, dp)
    pm = nns.parallelize(model, example, plan=strategy, world_size=world, cache_dir="/tmp/nns_test_cache", **options)
    if plan_name.startswith("zero"):  # the plan-aware optimizer shards its state per the ZeRO stage
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    else:  # a plain torch optimizer over the local shards
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return model, pm, opt, sched


def _train(pm, opt, sched, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = pm.train_step(_replica(_batch(step), pm.dp_rank, pm.dp_size)).detach().clone()
        if pm.dp_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= pm.dp_size * pm.plan.unit_size
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def _states(pm, opt) -> tuple[dict, dict]:
    from nnscaler_plugins.checkpoint import full_model_state, full_optimizer_state

    return full_model_state(pm), full_optimizer_state(pm, opt)


def _differences(got: tuple[dict, dict], want: tuple[dict, dict], what: str) -> list[str]:
    """Every model tensor and optimizer state entry compared exactly (torch.equal)."""
    problems = []
    (gm, go), (wm, wo) = got, want
    if set(gm) != set(wm):
        problems.append(f"{what}: model names differ: {sorted(set(gm) ^ set(wm))[:6]}")
    problems += [f"{what}: model {k} differs" for k in wm if k in gm and not torch.equal(gm[k], wm[k])]
    if set(go["state"]) != set(wo["state"]):
        problems.append(f"{what}: optimizer names differ: {sorted(set(go['state']) ^ set(wo['state']))[:6]}")
    for name, keys in wo["state"].items():
        for key, v in keys.items():
            g = go["state"].get(name, {}).get(key)
            same = torch.equal(g, v) if isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) else g == v
            if not same:
                problems.append(f"{what}: optimizer {name}[{key}] differs")
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]  # noqa: E731
    if strip(go["param_groups"]) != strip(wo["param_groups"]):
        problems.append(f"{what}: optimizer hyperparameters differ")
    if [sorted(g["params"]) for g in go["param_groups"]] != [sorted(g["params"]) for g in wo["param_groups"]]:
        problems.append(f"{what}: optimizer parameter groups differ")
    return problems


# -- worker tasks ------------------------------------------------------------------------------
def save_under_tp4_and_pipeline(rank: int, world: int, root: str):
    """Train 2 steps under tp 4, pipeline 2 x tp 2 and ZeRO-3, save each; also export the tp 4 model."""
    import nnscaler_plugins as nns

    out = {}
    for name in ("tp4", "pp2tp2", "zero3"):
        model, pm, opt, sched = _build(rank, world, name)
        _train(pm, opt, sched, range(2))
        nns.checkpoint.save(os.path.join(root, name), pm, opt, step=2, scheduler=sched.state_dict(), plan=name)
        out[name] = _states(pm, opt)
        if name in ("zero3", "tp4"):  # the same state as torch.distributed.checkpoint, written from the pieces
            nns.checkpoint.export_dcp(os.path.join(root, f"{name}_dcp"), pm, opt)
        if name == "tp4":
            nns.checkpoint.export(os.path.join(root, "tp4.pt"), pm)
            nns.checkpoint.export(os.path.join(root, "tp4_hf"), pm, hf_model=model)
    return out if rank == 0 else None


def load_on_two(rank: int, world: int, root: str, want: dict, m: int) -> tuple[list[str], list, tuple]:
    """Under other plans on another world size, from other initial weights, the loaded state is the
    saved one exactly and extra comes back: tp 4 into dp 2 (plain AdamW), ZeRO-3 on 4 into ZeRO-1
    on 2 (nns.build_optimizer). The dp 2 run then trains a step, saves, and trains `m` more: the
    run a resumed one must match."""
    import nnscaler_plugins as nns

    problems = []
    # ZeRO-1's optimizer also takes the plain AdamW state saved under tp 4: one format for both.
    built = None
    for saved, name in (("zero3_dcp", "zero1"), ("zero3", "zero1"), ("tp4", "zero1"), ("tp4", "dp2"),
                        ("tp4_dcp", "dp2")):
        if built is None or built[0] != name:
            built = (name, *_build(rank, world, name, seed=1))
        _, _, pm, opt, sched = built
        extra = nns.checkpoint.load(os.path.join(root, saved), pm, opt)
        if saved.endswith("_dcp"):  # weights and optimizer state only
            problems += _differences(_states(pm, opt), want[saved[:-4]], f"{saved} -> {name}")
            continue
        sched.load_state_dict(extra["scheduler"])
        problems += _differences(_states(pm, opt), want[saved], f"{saved} -> {name}")
        for e in getattr(opt, "entries", ()):  # ZeRO-1's fp32 masters are copies: they must be the loaded weights
            if e.master is not e.param and not torch.equal(e.master, e.shard.owned(e.param.detach().reshape(-1))):
                problems.append(f"{saved} -> {name}: the optimizer's master of {e.fqn} is not the loaded weight")
        if extra["step"] != 2 or extra["plan"] != saved or sched.last_epoch != 2:
            problems.append(f"extra came back as {extra}")
    _train(pm, opt, sched, range(2, 3))
    nns.checkpoint.save(os.path.join(root, "resume"), pm, opt, step=3, scheduler=sched.state_dict(),
                        rng=torch.get_rng_state())
    losses = _train(pm, opt, sched, range(3, 3 + m))
    return problems, losses, _states(pm, opt)


def resume_and_train(rank: int, world: int, root: str, plan_name: str, m: int):
    import nnscaler_plugins as nns

    _, pm, opt, sched = _build(rank, world, plan_name, seed=7)
    extra = nns.checkpoint.load(os.path.join(root, "resume"), pm, opt)
    sched.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    losses = _train(pm, opt, sched, range(extra["step"], extra["step"] + m))
    return losses, _states(pm, opt)


def bad_input(rank: int, world: int, root: str) -> dict:
    """Save called on rank 0 only; a checkpoint of another model; then a save on both ranks still works."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import CheckpointError

    out = {}
    small = torch.nn.Linear(4, 4)
    if rank == 0:
        start = time.monotonic()
        try:
            nns.checkpoint.save(os.path.join(root, "partial"), small, sync_timeout_s=3)
            out["partial"] = "no error"
        except CheckpointError as e:
            out["partial"] = str(e)
        out["partial_s"] = time.monotonic() - start
    torch.distributed.barrier()  # rank 1 meanwhile does other work, and never calls that save
    torch.manual_seed(0)
    mlp, inputs = models.mlp()
    pm = nns.parallelize(mlp, _replica(inputs, rank, world), plan="dp", cache_dir="/tmp/nns_test_cache")
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    try:
        nns.checkpoint.load(os.path.join(root, "tp4"), pm)
        out["mismatch"] = "no error"
    except CheckpointError as e:
        out["mismatch"] = str(e)
    out["untouched"] = all(torch.equal(v, pm.state_dict()[k]) for k, v in before.items())
    nns.checkpoint.save(os.path.join(root, "after_partial"), pm)  # the ranks still agree on later saves
    out["after_partial"] = os.path.exists(os.path.join(root, "after_partial", "metadata.json"))
    return out


# -- tests ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(workers4, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, workers4.run(save_under_tp4_and_pipeline, root)[0]


@pytest.fixture(scope="module")
def loaded_on_two(saved, workers2):
    root, want = saved
    return workers2.run(load_on_two, root, want, 2)[0]


def test_tp4_into_dp2_and_zero3_into_zero1_with_identical_state(loaded_on_two):
    problems = loaded_on_two[0]
    assert not problems, "\n".join(problems)


def test_pipeline_2x_tp2_loads_into_one_process(saved):
    import nnscaler_plugins as nns

    root, want = saved
    _, pm, opt, _ = _build(0, 1, "single", seed=3)
    extra = nns.checkpoint.load(os.path.join(root, "pp2tp2"), pm, opt)
    assert extra["plan"] == "pp2tp2"
    problems = _differences(_states(pm, opt), want["pp2tp2"], "pp2 x tp2 -> one process")
    assert not problems, "\n".join(problems)


def test_export_and_offline_merge(saved, tmp_path):
    from nnscaler_plugins.cli import main

    root, want = saved
    model_state = want["tp4"][0]
    sizes = [os.path.getsize(os.path.join(root, "tp4", f"rank-{r:05d}.bin")) for r in range(4)]
    assert max(sizes) < 1.1 * min(sizes), sizes  # every rank writes about a quarter of the bytes
    merged = str(tmp_path / "merged.pt")
    assert main(["merge-checkpoint", os.path.join(root, "tp4"), merged]) == 0
    exported = torch.load(os.path.join(root, "tp4.pt"), weights_only=True)
    for name, sd in (("merged", torch.load(merged, weights_only=True)), ("exported", exported)):
        assert set(sd) == set(model_state), name
        assert all(torch.equal(sd[k], v) for k, v in model_state.items()), name
    with_opt = str(tmp_path / "with_opt.pt")
    assert main(["merge-checkpoint", os.path.join(root, "tp4"), with_opt, "--with-optimizer"]) == 0
    full = torch.load(with_opt, weights_only=False)
    assert full["extra"]["step"] == 2
    assert all(torch.equal(full["optimizer"]["state"][n][k], v)
               for n, keys in want["tp4"][1]["state"].items() for k, v in keys.items())

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(root, "zero3_dcp"), str(tmp_path / "from_dcp.pt"))  # torch's own reader
    from_dcp = torch.load(str(tmp_path / "from_dcp.pt"), weights_only=False)
    assert all(torch.equal(from_dcp[k], v) for k, v in want["zero3"][0].items())
    assert all(torch.equal(from_dcp[f"optimizer.state.{n}.{k}"], v)
               for n, keys in want["zero3"][1]["state"].items() for k, v in keys.items())

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "tp4_hf"))
    loaded = hf.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model_state.items() if k in loaded)
    assert {k for k in model_state} <= set(loaded)


def test_resume_is_bit_exact(saved, loaded_on_two):
    """Losses and final state of a run resumed in fresh processes equal the run that never stopped."""
    root, _ = saved
    _, losses, state = loaded_on_two
    with Workers(2) as fresh:
        resumed, resumed_state = fresh.run(resume_and_train, root, "dp2", 2)[0]
    assert all(torch.equal(a, b) for a, b in zip(losses, resumed)), (losses, resumed)
    problems = _differences(resumed_state, state, "resumed vs uninterrupted")
    assert not problems, "\n".join(problems)


def test_bad_input_loses_nothing(saved, workers2):
    root, _ = saved
    results = workers2.run(bad_input, root)
    r0 = results[0]
    assert "rank(s) [1] did not call it within 3 s" in r0["partial"], r0["partial"]
    assert r0["partial_s"] < 30
    assert not os.path.exists(os.path.join(root, "partial"))
    for r in results:
        msg = r["mismatch"]
        assert "nothing was loaded" in msg and "fc1.weight [64, 16]" in msg and "lm_head.weight [128, 64]" in msg, msg
        assert r["untouched"] and r["after_partial"]


def test_corrupt_or_wrong_paths_give_clear_errors(saved, tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import CheckpointError

    root, _ = saved
    target = torch.nn.Linear(4, 4)
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(root, "tp4"), bad)
    from nnscaler_plugins.checkpoint.format import read_metadata

    # a file inside the checkpoint names the checkpoint (a common mistake on resume)
    assert read_metadata(os.path.join(bad, "metadata.json"))[0] == bad
    with open(os.path.join(bad, "rank-00002.bin"), "r+b") as f:  # one byte changed, same size
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="rank-00002.bin is corrupt"):
        nns.checkpoint.load(bad, models.gpt2_small(2)[0])
    with open(os.path.join(bad, "rank-00001.bin"), "r+b") as f:
        f.truncate(100)
    gpt2, _ = models.gpt2_small(2)  # the same names as the saved module: only the damage is in the way
    before = {k: v.clone() for k, v in gpt2.state_dict().items()}
    with pytest.raises(CheckpointError, match="rank-00001.bin has 100 bytes.*truncated"):
        nns.checkpoint.load(bad, gpt2)
    assert all(torch.equal(v, gpt2.state_dict()[k]) for k, v in before.items())
    with open(os.path.join(bad, "metadata.json"), "w") as f:
        f.write('{"format": "nnscaler-checkp')
    with pytest.raises(CheckpointError, match="metadata.json is corrupt"):
        nns.checkpoint.load(bad, gpt2)
    os.remove(os.path.join(bad, "metadata.json"))
    with pytest.raises(CheckpointError, match="metadata.json is missing"):
        nns.checkpoint.load(bad, gpt2)
    with pytest.raises(CheckpointError, match="is a file, not an nnscaler checkpoint directory"):
        nns.checkpoint.load(os.path.join(root, "tp4.pt"), target)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        nns.checkpoint.load(str(tmp_path / "nowhere"), target)


SAVER = textwrap.dedent("""
    import sys, torch
    import nnscaler_plugins as nns
    path = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])  # 25 MB a save
    i = 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i))
        nns.checkpoint.save(path, model, iteration=i)
        print(i, flush=True)
        i += 1
""")


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    import nnscaler_plugins as nns

    path = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", SAVER, path], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        completed = int(proc.stdout.readline())  # the first checkpoint is complete
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill while a later save is half written
            if any(".saving-" in n for n in os.listdir(tmp_path)):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
        else:
            pytest.fail("never saw a save in progress")
    finally:
        proc.kill()
        proc.wait()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    extra = nns.checkpoint.load(path, model)
    assert extra["iteration"] >= completed
    assert all(torch.all(p == extra["iteration"]) for p in model.parameters())
    # the next save clears what the killed one left behind
    nns.checkpoint.save(path, model, iteration=-1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_failed_save_keeps_previous_and_other_directories_are_never_replaced(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import CheckpointError

    model = torch.nn.Linear(4, 4)
    path = str(tmp_path / "ckpt")
    nns.checkpoint.save(path, model, step=1)
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="previous checkpoint there, if any, is untouched"):
        nns.checkpoint.save(path, model, step=2, callback=lambda: None)  # extra that cannot be pickled
    again = torch.nn.Linear(4, 4)
    assert nns.checkpoint.load(path, again) == {"step": 1}
    assert torch.equal(again.weight, first)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the failed save's directory is gone

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('keep me')")
    with pytest.raises(CheckpointError, match="not an nnscaler checkpoint; refusing to replace it"):
        nns.checkpoint.save(str(project), model)
    assert (project / "train.py").read_text() == "print('keep me')"


def test_fallback_swap_survives_a_crash_between_its_renames(tmp_path, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is missing, the old checkpoint is set aside before the new
    one moves in; a crash in between leaves it loadable, and the next save clears it away."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import atomic

    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    path = str(tmp_path / "ckpt")
    model = torch.nn.Linear(2, 2)
    nns.checkpoint.save(path, model, step=1)
    nns.checkpoint.save(path, model, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.rename(path, atomic.sibling(path, "previous", "0"))  # the state right after the first rename
    assert nns.checkpoint.load(path, model) == {"step": 2}
    nns.checkpoint.save(path, model, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and nns.checkpoint.load(path, model) == {"step": 3}


def _rank0_only(rank: int, world: int) -> list[str]:
    """Whole model and optimizer state kept by rank 0 only (what a framework checkpoint written by
    rank 0 needs): rank 0's equals the every-rank version, tied weights included; rank 1 keeps none.
    And a few names only, on every rank (what fetching one parameter needs)."""
    _, pm, opt, sched = _build(rank, world, "zero1")
    _train(pm, opt, sched, range(1))
    full, full_opt = pm.full_state_dict(), opt.full_state_dict()
    mine, mine_opt = pm.full_state_dict(rank0_only=True), opt.full_state_dict(rank0_only=True)
    names = sorted(full_opt["state"])[-2:]  # `only=`: just these (and their tied names), on every rank
    some, some_opt = pm.full_state_dict(only=names), opt.full_state_dict(only=names)
    if not set(names) <= set(some) or len(some) > len(names) + 1 or any(not torch.equal(v, full[k])
                                                                         for k, v in some.items()) \
            or set(some_opt["state"]) != set(names):
        return [f"only={names} gave {sorted(some)} and optimizer state of {sorted(some_opt['state'])}"]
    if rank != 0:
        return [] if not mine and not mine_opt["state"] else [f"rank {rank} kept {len(mine)} tensors"]
    problems = [f"{k} differs" for k in full if k not in mine or not torch.equal(full[k], mine[k])]
    problems += [f"optimizer {k} differs" for k in full_opt["state"]
                 if any(not torch.equal(a, b) for a, b in zip(full_opt["state"][k].values(),
                                                               mine_opt["state"].get(k, {}).values())
                        if torch.is_tensor(a))]
    return problems + ([] if set(mine_opt["state"]) == set(full_opt["state"]) else ["optimizer keys differ"])


def test_whole_state_kept_by_rank0_only(workers2):
    problems = workers2.run(_rank0_only)
    assert not any(problems), problems
