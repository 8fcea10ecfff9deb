"""`tp` plan vs PyTorch's DTensor tensor parallel (`parallelize_module`), 2 gloo processes.

    python benchmarks/tp_vs_dtensor.py

Llama small config. DTensor gets the standard Megatron plan (q/k/v, gate/up column-wise; o, down
row-wise; embeddings and LM head replicated). Ours is the `tp` strategy, which also splits the
vocabulary of the embedding, LM head and cross-entropy. Ratio = DTensor step time / ours.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402


def bench(rank: int, world: int, b: int, s: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import nnscaler_plugins as nns

    inputs = common.batch(b, s)
    ref = common.llama()
    mesh = init_device_mesh("cpu", (world,))
    for layer in ref.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    pm = nns.parallelize(common.llama(), inputs, plan="tp", cache_dir="/tmp/nns_bench_cache")
    opt_d = torch.optim.SGD(ref.parameters(), lr=1e-3)
    opt_o = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def dt_step():
        ref(**inputs).loss.backward()
        opt_d.step()
        opt_d.zero_grad()

    def our_step():
        pm.train_step(inputs)
        opt_o.step()
        opt_o.zero_grad()

    loss_d = ref(**inputs).loss.item()
    loss_o = pm(**inputs).loss.item()
    return common.time_paired(dt_step, our_step, iters=20, sync=dist.barrier), loss_d, loss_o


def main() -> None:
    rows = []
    b, s = 8, 128
    p, l_d, l_o = common.spawn(bench, 2, b, s)
    rows.append(("llama 4x256 (8 heads, 4 kv)", f"{b}x{s}", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}", *p.cells(),
                 f"{l_d:.5f} / {l_o:.5f}"))
    print(rows[-1], flush=True)
    print(common.record("tp_vs_dtensor.py: `tp` vs DTensor parallelize_module, 2 gloo processes (train step)", rows,
                        ("model", "batch", "DTensor ms", "ours ms", "ratio DTensor/ours of the median steps",
                         "median per-step ratio", "first loss DTensor / ours")))


if __name__ == "__main__":
    main()
