"""bf16 / fp16 with fp32 master weights: the same training as one process in that precision (within
the precision's own error against fp32), dynamic loss scaling skipping an overflowing step, and
the model-state memory of the 2 + 2 + 12 bytes per parameter formula under ZeRO."""
from __future__ import annotations

import copy

import torch

import models
from test_zero import memory_check, slice_batch

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(base: torch.nn.Module, inputs: dict, precision: str, steps: int) -> tuple[list[float], dict]:
    """One process: a half-precision copy of fp32 masters runs forward (autocast) and backward,
    AdamW steps the masters (with a fixed loss scale for fp16); returns losses and final masters."""
    from nnscaler_plugins.outputs import extract_loss

    master = copy.deepcopy(base)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    work = copy.deepcopy(base)
    losses = []
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    for _ in range(steps):
        if precision != "fp32":
            with torch.no_grad():
                for p, m in zip(work.parameters(), master.parameters()):
                    p.copy_(m.to(DTYPE[precision]).float())
            ctx = torch.autocast("cpu", dtype=DTYPE[precision])
        else:
            work.load_state_dict(master.state_dict())
            ctx = torch.autocast("cpu", enabled=False)
        with ctx:
            loss = extract_loss(work(**inputs))
        (loss * scale).backward()
        for p, m in zip(work.parameters(), master.parameters()):
            g = p.grad / scale
            m.grad = g.to(DTYPE[precision]).float() if precision != "fp32" else g
            p.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in master.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b if k in a)


def run_precision(rank: int, world: int, precision: str, stages=(1, 3), steps: int = 3, strategy: str = "dp",
                  options: dict | None = None) -> list[str]:
    import nnscaler_plugins as nns

    options = dict(options or {})

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    ref_losses, ref_state = reference(base, inputs, precision, steps)
    fp32_losses, fp32_state = reference(base, inputs, "fp32", steps)
    # The precision's own error against fp32 sets the tolerance (never below its rounding unit). Our
    # run and the one-process run each carry an error of that size against exact arithmetic, rounded
    # at different places (stage boundaries, another summation order), so two of it is what they may
    # differ by. It matters for gradients that are zero in exact arithmetic (GPT-2's key biases:
    # softmax ignores them): there each run's rounding noise has its own sign, and AdamW turns any
    # sign into a full lr-sized step.
    eps = torch.finfo(DTYPE[precision]).eps
    tol_param = 2 * max(max_diff(ref_state, fp32_state), eps)
    tol_loss = 2 * max(max(abs(a - b) for a, b in zip(ref_losses, fp32_losses)), eps)
    problems = []
    unit = options.get("pp", 1) * options.get("tp", 1)
    dp, micro = world // unit, options.get("micro_batches", 1)
    local = slice_batch(inputs, rank // unit, dp)
    graph = nns.capture(copy.deepcopy(base), kwargs=slice_batch(local, 0, micro))  # one micro-batch
    for stage in stages:
        plan = nns.plan(graph, strategy=strategy, world_size=world, zero=stage, precision=precision, **options)
        pm = nns.parallelize(copy.deepcopy(base), local, plan=plan, cache_dir="/tmp/nns_test_cache")
        pm.load_full_state_dict(initial)
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        assert pm.shards[next(iter(pm.shards))].dtype == DTYPE[precision]
        for step in range(steps):
            loss = pm.train_step(local).float()
            torch.distributed.all_reduce(loss)
            loss = loss.item() / world
            if abs(loss - ref_losses[step]) > tol_loss:
                problems.append(f"{precision} zero{stage} {strategy} step {step}: loss {loss} vs {ref_losses[step]} "
                                f"(tolerance {tol_loss:.3g})")
            opt.step()
            opt.zero_grad()
        state = opt.full_state_dict()["state"]
        masters = {k: v["master_param"] for k, v in state.items()}
        d = max_diff(masters, ref_state)
        if d > tol_param:
            problems.append(f"{precision} zero{stage} {strategy}: fp32 masters differ by {d:.3g} "
                            f"(tolerance {tol_param:.3g})")
        if stage:
            pm.train_step(local)
            psi = sum(fs.numel for fs in pm.zero_shards.values())
            problems += memory_check(pm, opt, psi, stage, precision, f"{precision} zero{stage} memory")
    return problems


def run_overflow(rank: int, world: int) -> list[str]:
    """fp16: an inf in one rank's gradient skips the step everywhere and halves the scale; a clean
    step after it updates the parameters."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, inputs = models.mlp()
    local = slice_batch(inputs, rank, world)
    problems = []
    for stage in (0, 2):
        pm = nns.parallelize(copy.deepcopy(model), local, plan="dp", zero=stage, precision="fp16",
                             cache_dir="/tmp/nns_test_cache")
        opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
        if opt.loss_scale != 2.0 ** 16:
            problems.append(f"initial scale {opt.loss_scale}")
        before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        out = pm(**local)
        opt.backward(out * (float("inf") if rank == 1 else 1.0))
        opt.step()
        opt.zero_grad()
        after = pm.full_state_dict()
        if not opt.last_step_skipped or opt.loss_scale != 2.0 ** 15 or pm.loss_scale != 2.0 ** 15:
            problems.append(f"zero{stage}: overflow did not skip/lower: {opt.last_step_skipped} {opt.loss_scale}")
        if any(not torch.equal(before[k], after[k]) for k in before):
            problems.append(f"zero{stage}: a skipped step changed parameters")
        pm.train_step(local)
        opt.step()
        if opt.last_step_skipped or all(torch.equal(before[k], pm.full_state_dict()[k]) for k in before):
            problems.append(f"zero{stage}: the clean step after an overflow did not update")
    return problems


def test_bf16_matches_single_process_bf16(workers2):
    problems = workers2.run(run_precision, "bf16", stages=(1, 3))
    assert not any(problems), problems


def test_fp16_matches_single_process_fp16(workers2):
    problems = workers2.run(run_precision, "fp16", stages=(2,))
    assert not any(problems), problems


def test_half_precision_with_pipelines(workers2, workers4):
    """bf16 and fp16 (dynamic loss scale) through pipeline stages: each stage runs under autocast
    and sends its boundary values in the compute dtype; the split backward of zero-bubble computes
    the weight gradients of the half-precision parameters. With 2 replicas, ZeRO 1 and 3."""
    problems = workers2.run(run_precision, "bf16", stages=(0,), strategy="1f1b",
                            options={"pp": 2, "micro_batches": 2})
    problems += workers2.run(run_precision, "bf16", stages=(0,), strategy="zero-bubble",
                             options={"pp": 2, "micro_batches": 2})
    problems += workers2.run(run_precision, "fp16", stages=(0,), strategy="1f1b",
                             options={"pp": 2, "micro_batches": 2})
    problems += workers4.run(run_precision, "bf16", stages=(1, 3), strategy="1f1b",
                             options={"pp": 2, "micro_batches": 2})
    assert not any(problems), problems


def test_fp16_overflow_skips_and_lowers_scale(workers2):
    problems = workers2.run(run_overflow)
    assert not any(problems), problems


def test_loss_scaler_schedule():
    from nnscaler_plugins.runtime.precision import LossScaler

    s = LossScaler(window=3)
    s.update(True)
    assert s.scale == 2.0 ** 15
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 16
    s = LossScaler(initial=2.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 1.0
