"""Gradient accumulation and clipping.

- N ranks x k accumulation steps under `no_sync()` give exactly the update of one device on the
  N*k batch (fp32) under ZeRO 2 and 3, and with fp16 loss scaling under ZeRO 1 (looser: 2e-3
  absolute, fp16's rounding at these weights' scale, where one step moves a weight by up to 0.1), and
  `no_sync()` really communicates nothing (the reducers' `launched` counters do not move).
- `optimizer.clip_grad_norm_` returns and applies what `torch.nn.utils.clip_grad_norm_` does on one
  device, each parameter counted once: ZeRO-3, tp x dp with ZeRO-2 and a pipeline (tied embedding
  on two stages) with ZeRO-1.
"""
from __future__ import annotations

import copy

import torch

import models
from test_zero import slice_batch


def _launched(pm) -> int:
    n = pm.grad_reducer.launched if pm.grad_reducer is not None else 0
    return n + (pm.zero3.launched if pm.zero3 is not None else 0)


def run_accumulation(rank: int, world: int, cases, k: int = 2, steps: int = 2) -> list[str]:
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    problems = []
    local = slice_batch(inputs, rank, world)  # this rank's share of the N*k batch
    micro = [slice_batch(local, i, k) for i in range(k)]
    graph = nns.capture(copy.deepcopy(base), kwargs=micro[0])
    for zero, precision, atol in cases:
        what = f"zero{zero} {precision}"
        plan = nns.plan(graph, strategy="dp", world_size=world, zero=zero, precision=precision)
        pm = nns.parallelize(copy.deepcopy(base), micro[0], plan=plan, cache_dir="/tmp/nns_test_cache")
        ref = copy.deepcopy(base)
        opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(steps):
            for i, mb in enumerate(micro):
                last = i == k - 1
                before = _launched(pm)
                if last:
                    opt.backward(extract_loss(pm(**mb)) / k)
                    if _launched(pm) == before:
                        problems.append(f"{what}: the boundary backward reduced nothing")
                else:
                    with pm.no_sync():
                        opt.backward(extract_loss(pm(**mb)) / k)
                    if _launched(pm) != before:
                        problems.append(f"{what}: gradients were reduced inside no_sync()")
            opt.step()
            opt.zero_grad()
            extract_loss(ref(**inputs)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            full = pm.full_state_dict()
            for name, t in ref.state_dict().items():
                if name in full and not torch.allclose(full[name], t, rtol=1e-5 if atol is None else 0,
                                                       atol=1e-6 if atol is None else atol):
                    problems.append(f"{what} step {step}: {name} max abs diff "
                                    f"{(full[name] - t).abs().max().item():.3g}")
    return problems


def run_clip(rank: int, world: int, strategy: str, options: dict, max_norm: float = 0.5) -> list[str]:
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    ref = copy.deepcopy(base)
    plan = nns.plan(copy.deepcopy(base), strategy=strategy, world_size=world,
                    example_inputs=slice_batch(inputs, 0, options.get("dp", world)), **options)
    pm = nns.parallelize(copy.deepcopy(base), slice_batch(inputs, rank // plan.unit_size, plan.dp), plan=plan,
                         cache_dir="/tmp/nns_test_cache")
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    problems = []
    for step in range(2):
        pm.train_step(slice_batch(inputs, pm.dp_rank, pm.dp_size))
        norm = opt.clip_grad_norm_(max_norm)
        extract_loss(ref(**inputs)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        if not torch.allclose(norm, want, rtol=1e-5):
            problems.append(f"{strategy} {options} step {step}: norm {norm.item()} vs {want.item()}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        full = pm.full_state_dict()
        for name, t in ref.state_dict().items():
            if name in full and not torch.allclose(full[name], t, rtol=1e-5, atol=1e-6):
                problems.append(f"{strategy} {options} step {step}: {name} differs after clipping")
    # the infinity norm, counted the same way
    pm.train_step(slice_batch(inputs, pm.dp_rank, pm.dp_size))
    extract_loss(ref(**inputs)).backward()
    inf_norm = opt.clip_grad_norm_(1e9, norm_type=float("inf"))
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
    if not torch.allclose(inf_norm, want, rtol=1e-5):
        problems.append(f"{strategy} {options}: inf norm {inf_norm.item()} vs {want.item()}")
    return problems


def test_accumulation_equals_one_device_on_the_whole_batch(workers2):
    # (ZeRO 0's no_sync is the plain reducer's, covered by test_equivalence)
    cases = [(2, "fp32", None), (3, "fp32", None), (1, "fp16", 2e-3)]
    problems = workers2.run(run_accumulation, cases)
    assert not any(problems), problems


def test_clip_zero3(workers2):
    problems = workers2.run(run_clip, "zero3", {})
    assert not any(problems), problems


def test_clip_tp_dp_and_pipeline(workers4):
    problems = workers4.run(run_clip, "hybrid", {"tp": 2, "dp": 2, "zero": 2})
    problems += workers4.run(run_clip, "1f1b", {"pp": 2, "dp": 2, "micro_batches": 2, "zero": 1})
    assert not any(problems), problems
