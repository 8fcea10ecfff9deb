"""`dp` plan vs torch.nn.parallel.DistributedDataParallel, 2 gloo processes, same model and data.

    python benchmarks/dp_vs_ddp.py

Each process times full training steps (forward, backward with gradient all-reduce, SGD step) of
both, interleaved, in the same run. Ratio = DDP step time / ours (target >= 0.97).
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

    td, to = [], []
    for _ in range(3):
        td.append(common.time_steps(ddp_step, iters=5, sync=dist.barrier))
        to.append(common.time_steps(our_step, iters=5, sync=dist.barrier))
    return min(td), min(to)


def main() -> None:
    rows = []
    for b, s in ((8, 128),):
        t_d, t_o = common.spawn(bench, 2, b, s)
        rows.append(("gpt2 4x256", f"{b}x{s} per rank", f"{t_d * 1e3:.1f}", f"{t_o * 1e3:.1f}", f"{t_d / t_o:.3f}"))
        print(rows[-1], flush=True)
    print(common.record("dp_vs_ddp.py: `dp` vs DistributedDataParallel, 2 gloo processes (train step)", rows,
                        ("model", "batch", "DDP ms", "ours ms", "ratio DDP/ours (target >= 0.97)")))


if __name__ == "__main__":
    main()
