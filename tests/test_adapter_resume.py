"""The optimizer state the Lightning and Hugging Face adapters put in their checkpoints
(`adapters.resume`): saved on 2 processes, it loads on 4 under other plans (a plain torch optimizer
and nns.build_optimizer's alike) and equals what was saved; state that can only be stored per rank
is refused under another plan or process count, naming both, before anything changes.

The adapters' own runs (tests/test_lightning.py, tests/test_hf_trainer.py) resume under another plan
end to end; this covers the change of process count, which needs two launches there."""
from __future__ import annotations

import copy

import pytest
import torch

import models


def _build(plan: str, options: dict, world: int, dp: int, kind: str):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.gpt2_small()
    model.eval()
    n = models.BATCH // dp
    rank = torch.distributed.get_rank()
    local = {k: v[(rank // (world // dp)) * n:(rank // (world // dp) + 1) * n] for k, v in batch.items()}
    pm = nns.parallelize(copy.deepcopy(model), local, plan=plan, cache_dir="/tmp/nns_test_cache", **options)
    if kind == "sharded":
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    elif kind == "outside":  # also a tensor the plan does not know: stored per rank
        extra = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.AdamW([{"params": list(pm.parameters()) + [extra]}], lr=1e-2)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    return pm, opt, local


def save_on_two(rank: int, world: int) -> dict:
    from nnscaler_plugins.adapters.resume import save_state
    from nnscaler_plugins.checkpoint import full_optimizer_state

    out = {}
    for name, plan, options, kind in (("dp", "dp", {}, "plain"), ("zero2", "zero2", {}, "sharded"),
                                      ("outside", "dp", {}, "outside")):
        pm, opt, local = _build(plan, options, world, 2, kind)
        for _ in range(2):
            pm.train_step(local)
            if kind == "outside":
                for g in opt.param_groups:
                    g["params"][-1].grad = torch.ones(3)
            opt.step()
            opt.zero_grad()
        saved = save_state(pm, opt)
        whole = full_optimizer_state(pm, opt) if kind != "outside" else None
        out[name] = (saved, whole)
    return out if rank == 0 else None


def load_elsewhere(rank: int, world: int, saved: dict, cases: list) -> list[str]:
    from nnscaler_plugins.adapters import resume
    from nnscaler_plugins.checkpoint import full_optimizer_state

    report = []
    for name, plan, options, dp, kind in cases:
        pm, opt, _ = _build(plan, options, world, dp, kind)
        state, whole = saved[name]
        found = resume.agree(resume.problems(pm, opt, state))
        if whole is None:  # per-rank state: only its own plan and world take it; refused otherwise, naming both
            before = copy.deepcopy(opt.state_dict())
            try:
                resume.refuse("test", found, state.get(resume.PLAN), pm)
            except resume.ResumeError as e:
                report.append(f"refused: {e}")
                if opt.state_dict()["state"] != before["state"]:
                    report.append(f"{name} -> {plan}: state changed by a refused resume")
                continue
            resume.load_state(pm, opt, state)
            if not opt.state_dict()["state"]:
                report.append(f"{name} -> {plan}: nothing loaded")
            continue
        if found:
            report.append(f"{name} -> {plan}: {found}")
            continue
        resume.load_state(pm, opt, state)
        got = full_optimizer_state(pm, opt)
        for fqn, keys in whole["state"].items():
            for k, v in keys.items():
                g = got["state"].get(fqn, {}).get(k)
                if not (torch.equal(torch.as_tensor(g), torch.as_tensor(v))):
                    report.append(f"{name} -> {plan}: {fqn}[{k}] differs after the resume")
    return report


@pytest.fixture(scope="module")
def saved(workers2):
    return workers2.run(save_on_two)[0]


def test_whole_state_saved_on_two_loads_on_four_under_other_plans(saved, workers4):
    cases = [("dp", "hybrid", {"tp": 2, "dp": 2}, 2, "plain"),       # plain -> tensor parallel x 2 replicas
             ("dp", "zero3", {}, 4, "sharded"),                      # plain -> ZeRO-3's chunks
             ("zero2", "1f1b", {"pp": 2, "dp": 2}, 2, "plain")]      # ZeRO-2's masters -> a pipeline
    report = workers4.run(load_elsewhere, saved, cases)
    assert not any(report), report


def test_per_rank_state_is_refused_under_another_plan_or_world(saved, workers2, workers4):
    report = workers4.run(load_elsewhere, saved, [("outside", "dp", {}, 4, "outside")])[0]
    assert len(report) == 1 and "saved per rank by plan 'dp'" in report[0] and "this run has 4 process" in report[0] \
        and "this run is plan 'dp'" in report[0] and "nothing was restored" in report[0], report
    report = workers2.run(load_elsewhere, saved, [("outside", "tp", {}, 1, "outside")])[0]
    assert len(report) == 1 and "saved per rank by plan 'dp'" in report[0] and "this run is plan 'tp'" in report[0], \
        report
    assert workers2.run(load_elsewhere, saved, [("outside", "dp", {}, 2, "outside")]) == [[], []]  # its own plan
