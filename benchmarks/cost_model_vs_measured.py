"""Predicted vs measured step time: several plans of one model, run on local gloo processes.

Each plan of a small GPT-2 is made with `nns.plan`, priced by `nns.simulate` on the measured
`local-cpu` cluster (the roofline cost model, and the profiling mode that times every op on this
machine), then run for real: two processes over gloo on 127.0.0.1, one thread each, `train_step`
timed after warm-up (median of the timed steps, the slower rank). Reported: both predictions
against the measurement, and their Spearman rank correlation (does the model order plans the way
the machine does?).

    python benchmarks/cost_model_vs_measured.py       # appended to RESULTS.md
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

# (label, strategy, options, data-parallel replicas)
PLANS = [
    ("dp", "dp", {}, 2),
    ("dp, 2 micro-batches", "dp", {"micro_batches": 2}, 2),
    ("tp", "tp", {}, 1),
    ("tp, full recompute", "megatron", {"tp": 2, "recompute": "full"}, 1),
    ("1f1b pp=2, 4 micro-batches", "1f1b", {"pp": 2, "micro_batches": 4}, 1),
    ("gpipe pp=2, 4 micro-batches", "gpipe", {"pp": 2, "micro_batches": 4}, 1),
    ("1f1b pp=2, 8 micro-batches", "1f1b", {"pp": 2, "micro_batches": 8}, 1),
    ("auto", "auto", {}, 1),
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
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
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
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    spec = nns.cluster("local-cpu", devices=WORLD)
    print(spec.describe(), flush=True)
    data = batch(B, S, MODEL["vocab"])
    model = gpt2(**MODEL)
    rows, predicted, profiled, measured = [], [], [], []
    profiler = OpProfiler()
    for label, strategy, options, dp in PLANS:
        replica = _replica(data, dp, 0)
        plan = nns.plan(model, strategy=strategy, world_size=WORLD, example_inputs=replica,
                        cluster=spec if strategy == "auto" else None, **options)
        est = nns.simulate(plan, spec)
        prof = nns.simulate(plan, spec, cost_model=CostModel(plan.graph, spec, profiler=profiler))
        dp = plan.dp
        t = spawn(run_plan, WORLD, plan, dp, args.steps)
        predicted.append(est.step_time_s)
        profiled.append(prof.step_time_s)
        measured.append(t)
        rows.append((label, f"{plan.unit_size} x {plan.dp}", f"{plan.num_micro_batches}", f"{1e3 * est.step_time_s:.1f}",
                     f"{1e3 * prof.step_time_s:.1f}", f"{1e3 * t:.1f}", f"{est.step_time_s / t:.2f}",
                     f"{prof.step_time_s / t:.2f}"))
        print(" | ".join(rows[-1]), flush=True)
    rho, rho_p = spearman(predicted, measured), spearman(profiled, measured)
    mape = 100 * statistics.mean(abs(p / m - 1) for p, m in zip(predicted, measured))
    mape_p = 100 * statistics.mean(abs(p / m - 1) for p, m in zip(profiled, measured))
    print(f"Spearman rank correlation: roofline {rho:.2f}, profiled {rho_p:.2f}; MAPE roofline {mape:.0f} %, "
          f"profiled {mape_p:.0f} %")
    if not args.no_record:
        record("cost_model_vs_measured.py: predicted vs measured step time, GPT-2 4x256 (batch 8 x 128), "
               f"{WORLD} gloo processes", rows,
               ("plan", "unit x dp", "micro-batches", "roofline ms", "profiled ms", "measured ms", "roofline / measured",
                "profiled / measured"),
               f"Spearman rank correlation with the measurement: roofline **{rho:.2f}**, profiling mode **{rho_p:.2f}** "
               f"(MAPE {mape:.0f} % and {mape_p:.0f} %). Cluster: {spec.describe()}. The roofline uses the measured "
               "single-thread matmul rate and memory bandwidth with no fusion (eager PyTorch); the profiling mode times "
               "each op of the plan's pieces on this machine.")


if __name__ == "__main__":
    main()
