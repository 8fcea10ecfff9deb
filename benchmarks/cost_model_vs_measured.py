"""Predicted vs measured step time: several plans of one model, run on local gloo processes.

Each plan of a small GPT-2 is made with `nns.plan`, priced by `nns.simulate` on the measured
`local-cpu` cluster (the cost model with this machine's kernel table: matmul and element-wise speed by
size, cache effects included, and gloo's alpha-beta, all measured by `calibrate.py`; and the profiling
mode that times every op on this machine), then run for real: two processes over gloo on 127.0.0.1,
one thread each, `train_step` timed after warm-up (median of the timed steps, the slower rank).
Reported: both predictions against the measurement, and their Spearman rank correlation (does the
model order plans the way the machine does?). With `--repeats N` the measurement is taken N times
(plans interleaved, so a burst of load from other processes hits every plan alike) and the spread of
the correlation over the repeats is reported with the correlation of the per-plan medians.

    python benchmarks/cost_model_vs_measured.py --repeats 3      # appended to RESULTS.md
    python benchmarks/cost_model_vs_measured.py --remeasure      # measure this machine again first
    python benchmarks/cost_model_vs_measured.py --predict-only   # the model's numbers only, nothing run

Take it on an idle machine: other processes on the same cores change the measurement, not the model.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import batch, gpt2, record, spawn  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402
from nnscaler_plugins.search.costmodel import CostModel  # noqa: E402
from nnscaler_plugins.search.profiler import OpProfiler  # noqa: E402

WORLD = 2
B, S = 8, 128
MODEL = dict(n_layer=4, n_embd=256, n_head=8, vocab=2048)

# (label, strategy, options, data-parallel replicas): the choices a user weighs on two devices (data,
# tensor or pipeline parallelism; gradient accumulation; recomputation), each a different program.
# Plans the machine runs within noise of each other say nothing about ranking (an earlier set had
# five within 3 %, among them gpipe and 1f1b at equal micro-batches, and "auto", which picked the tp
# plan already in the set), so each plan here differs from the others in what the step does.
PLANS = [
    ("dp", "dp", {}, 2),
    ("dp, 4 micro-batches", "dp", {"micro_batches": 4}, 2),
    ("dp, full recompute", "megatron", {"dp": 2, "recompute": "full"}, 2),
    ("tp", "tp", {}, 1),
    ("tp, 4 micro-batches", "megatron", {"tp": 2, "micro_batches": 4}, 1),
    ("tp, full recompute", "megatron", {"tp": 2, "recompute": "full"}, 1),
    ("1f1b pp=2, 2 micro-batches", "1f1b", {"pp": 2, "micro_batches": 2}, 1),
    ("1f1b pp=2, 8 micro-batches", "1f1b", {"pp": 2, "micro_batches": 8}, 1),
]


def _replica(data: dict, dp: int, r: int) -> dict:
    n = data["input_ids"].shape[0] // dp
    return {k: v[r * n:(r + 1) * n] for k, v in data.items()}


def run_plan(rank: int, world: int, plan, dp: int, steps: int) -> float:
    """Time train_step on this rank; returns the slowest rank's median (rank 0 reports)."""
    import torch.distributed as dist

    model = gpt2(**MODEL)
    data = batch(B, S, MODEL["vocab"])
    local = _replica(data, dp, rank // plan.unit_size)
    pm = nns.parallelize(model, local, plan=plan, cache_dir="/tmp/nns_bench_cache")
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        t = time.perf_counter()
        pm.train_step(local)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t)
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):  # tied values share their mean rank (else a tie is ordered by list position)
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        pos = 0
        while pos < len(order):
            end = pos
            while end + 1 < len(order) and x[order[end + 1]] == x[order[pos]]:
                end += 1
            for j in range(pos, end + 1):
                r[order[j]] = (pos + end) / 2
            pos = end + 1
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remeasure", action="store_true", help="measure this machine again (the cache is kept otherwise)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--predict-only", action="store_true", help="price the plans, run nothing")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if args.remeasure:
        from nnscaler_plugins.search.calibrate import cache_path
        path = cache_path(None)
        if os.path.exists(path):
            os.remove(path)
    spec = nns.cluster("local-cpu", devices=WORLD)
    print(spec.describe(), flush=True)
    data = batch(B, S, MODEL["vocab"])
    model = gpt2(**MODEL)
    rows, predicted, profiled, plans = [], [], [], []
    profiler = OpProfiler()
    for label, strategy, options, dp in PLANS:
        replica = _replica(data, dp, 0)
        plan = nns.plan(model, strategy=strategy, world_size=WORLD, example_inputs=replica,
                        cluster=spec if strategy == "auto" else None, **options)
        est = nns.simulate(plan, spec)
        prof = nns.simulate(plan, spec, cost_model=CostModel(plan.graph, spec, profiler=profiler))
        predicted.append(est.step_time_s)
        profiled.append(prof.step_time_s)
        plans.append(plan)
        print(f"{label}: predicted {1e3 * est.step_time_s:.1f} ms, profiled {1e3 * prof.step_time_s:.1f} ms", flush=True)
    if args.predict_only:
        return
    runs: list[list[float]] = [[] for _ in plans]
    per_repeat = []
    for r in range(args.repeats):
        for i, plan in enumerate(plans):
            runs[i].append(spawn(run_plan, WORLD, plan, plan.dp, args.steps))
        per_repeat.append(spearman(predicted, [x[r] for x in runs]))
        print(f"repeat {r + 1}: measured {[round(1e3 * x[r], 1) for x in runs]} ms, Spearman {per_repeat[-1]:.2f}",
              flush=True)
    measured = [statistics.median(x) for x in runs]
    for (label, _, _, _), plan, p, q, t, x in zip(PLANS, plans, predicted, profiled, measured, runs):
        rows.append((label, f"{plan.unit_size} x {plan.dp}", f"{plan.num_micro_batches}", f"{1e3 * p:.1f}",
                     f"{1e3 * q:.1f}", f"{1e3 * t:.1f}", f"{1e3 * min(x):.1f}-{1e3 * max(x):.1f}", f"{p / t:.2f}",
                     f"{q / t:.2f}"))
        print(" | ".join(rows[-1]), flush=True)
    rho, rho_p = spearman(predicted, measured), spearman(profiled, measured)
    spread = (f"per repeat {', '.join(f'{x:.2f}' for x in per_repeat)} (min {min(per_repeat):.2f}, median "
              f"{statistics.median(per_repeat):.2f}, max {max(per_repeat):.2f})")
    # how far apart the plans are, against how much one plan's repeats move
    ordered = sorted(measured)
    gaps = [b / a - 1 for a, b in zip(ordered, ordered[1:])]
    noise = statistics.median((max(x) - min(x)) / statistics.median(x) for x in runs)
    plan_spread = (f"measured plans span {ordered[-1] / ordered[0]:.2f}x (fastest to slowest); adjacent plans "
                   f"{100 * min(gaps):.1f} % apart at the closest, median {100 * statistics.median(gaps):.1f} %; "
                   f"a plan's repeats spread {100 * noise:.1f} % (median range / median)")
    mape = 100 * statistics.mean(abs(p / m - 1) for p, m in zip(predicted, measured))
    mape_p = 100 * statistics.mean(abs(p / m - 1) for p, m in zip(profiled, measured))
    load = os.getloadavg()[0]
    print(f"Spearman rank correlation of the medians: model {rho:.2f}, profiled {rho_p:.2f}; model {spread}; "
          f"MAPE model {mape:.0f} %, profiled {mape_p:.0f} %; load average {load:.1f}; {plan_spread}")
    if not args.no_record:
        record("cost_model_vs_measured.py: predicted vs measured step time, GPT-2 4x256 (batch 8 x 128), "
               f"{WORLD} gloo processes", rows,
               ("plan", "unit x dp", "micro-batches", "model ms", "profiled ms", "measured ms (median)",
                f"measured range ({args.repeats} runs)", "model / measured", "profiled / measured"),
               f"Spearman rank correlation with the median measurement: model **{rho:.2f}**, profiling mode "
               f"**{rho_p:.2f}** (MAPE {mape:.0f} % and {mape_p:.0f} %); model against each repeat: {spread}; "
               f"{plan_spread}. Load "
               f"average {load:.1f} at the end (other processes on the 2 cores move the measurement). Cluster: "
               f"{spec.describe()}. The model uses this machine's measured kernel table (matmul by shape, element-wise "
               "by size, both with the cache's speed-up; no fusion, eager PyTorch; each op's and each view's dispatch as "
               "training pays it, forward and backward) and gloo's measured alpha-beta (fastest of several batches), "
               "communication on the compute cores (nothing overlaps); the profiling mode times each op of the "
               "plan's pieces on this machine.")


if __name__ == "__main__":
    main()
