"""Our `zero1/2/3` plans vs DeepSpeed ZeRO 1/2/3, 2 gloo processes, same model, data, AdamW, fp32.

    python benchmarks/zero_vs_deepspeed.py

Step time: in one pair of processes per stage, full training steps (forward, backward, optimizer
step) of both alternate step by step; reported are the medians, their ratio DeepSpeed / ours (> 1: ours is
faster) and beside it the median per-pair ratio. Peak memory: a fresh pair of processes per framework and
stage trains a few steps; reported is each rank's growth of peak resident memory (ru_maxrss) from
just before the engine / module is built, i.e. model states, activations and communication
buffers as the process really held them (CPU allocator caching included).
"""
from __future__ import annotations

import copy
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

B, S = 4, 128
LR = 1e-3


def _ds_env(rank: int, world: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "DS_ACCELERATOR": "cpu",
                       "DS_BUILD_OPS": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def _ds_engine(model: torch.nn.Module, stage: int):
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)
    return engine


def _ours(model: torch.nn.Module, inputs: dict, stage: int):
    import nnscaler_plugins as nns

    pm = nns.parallelize(model, inputs, plan=f"zero{stage}", cache_dir="/tmp/nns_bench_cache")
    return pm, nns.build_optimizer(pm, torch.optim.AdamW, lr=LR)


def bench_time(rank: int, world: int, stage: int):
    import torch.distributed as dist

    _ds_env(rank, world)
    inputs = common.batch(B, S, seed=10 + rank)
    base = common.gpt2()
    pm, opt = _ours(copy.deepcopy(base), inputs, stage)  # captured before DeepSpeed patches F.linear
    engine = _ds_engine(copy.deepcopy(base), stage)

    def ds_step():
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()

    def our_step():
        pm.train_step(inputs)
        opt.step()
        opt.zero_grad()

    return common.time_paired(ds_step, our_step, warmup=2, iters=10, sync=dist.barrier)


def bench_memory(rank: int, world: int, stage: int, which: str) -> list[float]:
    import torch.distributed as dist

    _ds_env(rank, world)
    inputs = common.batch(B, S, seed=10 + rank)
    model = common.gpt2()
    if which == "deepspeed":
        import deepspeed  # noqa: F401  (imported before the baseline: its import is not the engine's memory)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "deepspeed":
        engine = _ds_engine(model, stage)
        for _ in range(3):
            engine.backward(engine(**inputs).loss)
            engine.step()
    else:
        pm, opt = _ours(model, inputs, stage)
        for _ in range(3):
            pm.train_step(inputs)
            opt.step()
            opt.zero_grad()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024  # KiB -> MiB
    out = torch.tensor([grown])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, out)
    return [float(t) for t in gathered]


def main() -> None:
    rows = []
    for stage in (1, 2, 3):
        p = common.spawn(bench_time, 2, stage)
        mem_ds = common.spawn(bench_memory, 2, stage, "deepspeed")
        mem_ours = common.spawn(bench_memory, 2, stage, "ours")
        rows.append((f"ZeRO-{stage}", f"{p.a * 1e3:.0f}", f"{p.b * 1e3:.0f}", *p.cells(2),
                     " / ".join(f"{m:.0f}" for m in mem_ds), " / ".join(f"{m:.0f}" for m in mem_ours),
                     " / ".join(f"{d / o:.2f}" for d, o in zip(mem_ds, mem_ours))))
        print(rows[-1], flush=True)
    params = sum(p.numel() for p in common.gpt2().parameters())
    print(common.record(
        "zero_vs_deepspeed.py: zero1/2/3 plans vs DeepSpeed 0.19 ZeRO 1/2/3, 2 gloo processes (train step)", rows,
        ("stage", "DeepSpeed ms", "ours ms", "ratio DS/ours of the median steps", "median per-step ratio",
         "DS peak MiB (rank 0 / 1)",
         "ours peak MiB (rank 0 / 1)", "memory ratio DS/ours"),
        notes=f"GPT-2 4 layers x 256 ({params / 1e6:.1f} M parameters), batch {B}x{S} per rank, AdamW, fp32. "
              "Peak = growth of the process's peak RSS from just before the engine/module is built "
              "(3 training steps)."))


if __name__ == "__main__":
    main()
