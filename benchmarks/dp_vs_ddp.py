"""`dp` plan vs torch.nn.parallel.DistributedDataParallel, 2 gloo processes, same model and data.

    python benchmarks/dp_vs_ddp.py

Each process times full training steps (forward, backward with gradient all-reduce, SGD step) of
both, alternating step by step, in the same run. Ratio = DDP's median step time / ours
(target >= 0.97), with the median per-step ratio beside it.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402


def bench(rank: int, world: int, b: int, s: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nnscaler_plugins as nns

    inputs = common.batch(b, s, seed=10 + rank)
    ddp = DDP(common.gpt2())
    pm = nns.parallelize(common.gpt2(), inputs, plan="dp", cache_dir="/tmp/nns_bench_cache")
    opt_d = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    opt_o = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def ddp_step():
        ddp(**inputs).loss.backward()
        opt_d.step()
        opt_d.zero_grad()

    def our_step():
        pm.train_step(inputs)
        opt_o.step()
        opt_o.zero_grad()

    return common.time_paired(ddp_step, our_step, iters=30, sync=dist.barrier)


def main() -> None:
    rows = []
    for b, s in ((8, 128),):
        p = common.spawn(bench, 2, b, s)
        rows.append(("gpt2 4x256", f"{b}x{s} per rank", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}", *p.cells()))
        print(rows[-1], flush=True)
    print(common.record("dp_vs_ddp.py: `dp` vs DistributedDataParallel, 2 gloo processes (train step)", rows,
                        ("model", "batch", "DDP ms", "ours ms", "ratio DDP/ours of the median steps (target >= 0.97)",
                         "median per-step ratio")))


if __name__ == "__main__":
    main()
