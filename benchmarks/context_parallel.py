"""Context parallelism against tensor and data parallelism on 4 gloo processes: the longest sequence
each trains within a per-device activation budget, and step times at one common length.

    python benchmarks/context_parallel.py [--budget-mib 8] [--common 1024] [--max-len 8192]

Memory is measured, not estimated: the bytes of the distinct storages autograd saves for backward
during one training step on each device (parameters excepted; the largest device counts), at
doubling lengths until the budget is passed. A CPU process's resident size is dominated by the
runtime and allocator caches, so the saved activations are the quantity that grows with the
sequence and the one the budget applies to. Each plan runs its smallest batch there: one row per
device under dp, one row in all under tp and cp. Step times: the same global batch (4 rows) for every
plan, forward + backward + SGD step, median of alternating steps; ratios are against dp.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

PLANS = {"dp": ("dp", {}), "tp": ("tp", {}), "cp ring": ("cp", {"cp_comm": "ring"}),
         "cp allgather": ("cp", {"cp_comm": "allgather"}), "cp ulysses": ("cp", {"cp_comm": "ulysses"})}
ROWS = 4  # global batch of the step-time comparison


def _model(length: int):
    return common.llama(n_layer=2, hidden=64, heads=4, kv_heads=4, vocab=256, positions=length)


def _local_batch(plan: str, rank: int, world: int, length: int, rows: int = ROWS) -> dict:
    """This rank's rows of a global batch of `rows` (dp: rows / world each; tp and cp: all)."""
    full = common.batch(rows, length, vocab=256)
    if plan == "dp":
        n = rows // world
        return {k: v[rank * n:(rank + 1) * n] for k, v in full.items()}
    return full


def _saved_bytes(fn, params) -> int:
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def longest(rank: int, world: int, plan: str, budget: int, start: int, max_len: int):
    import torch.distributed as dist

    import nnscaler_plugins as nns

    strategy, options = PLANS[plan]
    rows, length, best = [], start, 0
    while length <= max_len:
        model = _model(length)
        # the smallest batch each plan can run: one row per device for dp, one row for tp and cp
        inputs = _local_batch(plan, rank, world, length, rows=world if plan == "dp" else 1)
        pm = nns.parallelize(model, inputs, plan=strategy, cache_dir="/tmp/nns_bench_cache_cp", **options)
        used = torch.tensor([_saved_bytes(lambda: pm.train_step(inputs), list(pm.parameters()))])
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        rows.append((length, int(used.item())))
        if used.item() > budget:
            break
        best = length
        length *= 2
    return best, rows


def step_time(rank: int, world: int, plan: str, length: int, iters: int):
    import torch.distributed as dist

    import nnscaler_plugins as nns

    strategy, options = PLANS[plan]
    inputs = _local_batch(plan, rank, world, length)
    pm = nns.parallelize(_model(length), inputs, plan=strategy, cache_dir="/tmp/nns_bench_cache_cp", **options)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=1e-3)
    times = []
    for i in range(iters + 2):
        dist.barrier()
        t = time.perf_counter()
        pm.train_step(inputs)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=float, default=8.0)
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--common", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    budget = int(args.budget_mib * 2 ** 20)
    out = []
    for plan in ("dp", "tp", "cp ring"):
        best, rows = common.spawn(longest, args.world, plan, budget, args.start, args.max_len)
        seen = ", ".join(f"{n}: {b / 2 ** 20:.1f}" for n, b in rows)
        out.append((plan, str(best), seen))
        print(plan, best, seen, flush=True)
    times = {}
    for plan in PLANS:
        times[plan] = common.spawn(step_time, args.world, plan, args.common, args.iters)
        print(plan, f"{times[plan]:.3f} s", flush=True)
    rows = [(p, b, seen, f"{times[p]:.3f}", f"{times[p] / times['dp']:.2f}") for p, b, seen in out]
    rows += [(p, "-", "-", f"{times[p]:.3f}", f"{times[p] / times['dp']:.2f}") for p in PLANS if p not in ("dp", "tp",
                                                                                                          "cp ring")]
    text = common.record(
        "Context parallelism vs tp and dp (benchmarks/context_parallel.py)", rows,
        ("plan (4 gloo processes)", f"longest length within {args.budget_mib:g} MiB saved activations/device",
         "saved MiB per device by length", f"step s at {args.common} x {ROWS} rows", "step / dp"),
        notes=f"Llama 2 layers, hidden 64, 4 heads (4 key/value heads), vocab 256; lengths doubled from "
              f"{args.start}; memory at the smallest batch (dp one row per device, tp and cp one row). Step times: median of {args.iters} steps, same global batch for every plan. "
              "CPU math path for attention blocks; ring exchanges are point-to-point gloo sends.")
    print(text)


if __name__ == "__main__":
    main()
