"""Peak extra memory per rank of nns.checkpoint.save and load (sharded pieces) against gathering
whole tensors first (what a save did before: every rank made the whole model and, for the plan's
optimizer, its whole state), 4 gloo processes, ZeRO-3, AdamW.

Memory is the process's anonymous resident memory (/proc/self/status RssAnon, sampled every
millisecond by a thread): what the operation allocates, not the page cache of the files it maps.
Each rank also reports the bytes of its own pieces (its ZeRO-3 chunks and their optimizer state),
the bound a save must stay within, and for load the elements it asked the files for.

    python benchmarks/checkpoint_memory.py [--layers 8 --embd 768]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MiB = 2 ** 20


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The largest RssAnon above the value at entry, while inside."""

    def __enter__(self) -> "Peak":
        self.base = self.peak = _anon()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, _anon())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def run(rank: int, world: int, layers: int, embd: int, root: str) -> dict:
    import torch.distributed as dist

    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import full_model_state, full_optimizer_state

    model = common.gpt2(n_layer=layers, n_embd=embd, n_head=12, vocab=8192)
    b = common.batch(world * 2, 64, vocab=8192)
    n = b["input_ids"].shape[0] // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}
    pm = nns.parallelize(model, mine, plan="zero3", world_size=world, cache_dir="/tmp/nns_bench_cache")
    del model
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    pm.train_step(mine)
    opt.step()
    opt.zero_grad()
    own = sum(p.numel() * p.element_size() for p in pm.parameters())
    own += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
    total = sum(t.numel() * t.element_size() for t in pm.full_state_dict().values())
    import gc
    gc.collect()
    dist.barrier()
    path = os.path.join(root, "ckpt")
    with Peak() as save_peak:
        nns.checkpoint.save(path, pm, opt, step=1)
    dist.barrier()
    with Peak() as gather_peak:  # the former save: whole model and whole optimizer state on every rank
        state, optim = full_model_state(pm), full_optimizer_state(pm, opt)
        if rank == 0:
            torch.save({"model": state, "optim": optim}, os.path.join(root, "gathered.pt"))
        del state, optim
    gc.collect()
    dist.barrier()
    from nnscaler_plugins.checkpoint import format as fmt

    asked = {"n": 0}
    read = fmt.TensorReader.read

    def counting(self, key, entry, box):
        t = read(self, key, entry, box)
        asked["n"] += t.numel() * t.element_size()
        return t
    fmt.TensorReader.read = counting
    with Peak() as load_peak:
        nns.checkpoint.load(path, pm, opt)
    fmt.TensorReader.read = read
    dist.barrier()
    return {"own": own, "total": total, "save": save_peak.extra, "gathered": gather_peak.extra,
            "load": load_peak.extra, "read": asked["n"]}


def per_rank(rank: int, world: int, *args) -> list:
    import torch.distributed as dist

    out = run(rank, world, *args)
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    return everyone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="nns_ckpt_mem_")
    try:
        results = common.spawn(per_rank, a.world, a.layers, a.embd, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for r, x in enumerate(results):
        rows.append((str(r), f"{x['total'] / MiB:.0f}", f"{x['own'] / MiB:.0f}", f"{x['save'] / MiB:.0f}",
                     f"{x['gathered'] / MiB:.0f}", f"{x['load'] / MiB:.0f}", f"{x['read'] / MiB:.0f}"))
    text = common.record(
        f"checkpoint_memory.py: peak extra memory per rank of save and load, GPT-2 {a.layers}x{a.embd} (vocab 8192), "
        f"ZeRO-3 on {a.world} gloo processes, AdamW",
        rows, ("rank", "model MiB (fp32, whole)", "own pieces MiB (params + AdamW state)", "save extra MiB",
               "gather-first save extra MiB", "load extra MiB", "load bytes read MiB"),
        "Extra = peak RssAnon above the value before the call. save writes each rank's pieces as they are in its "
        "memory; gather-first is the former save (whole model and whole optimizer state made on every rank, rank 0 "
        "writing). load reads only the elements of the rank's own pieces (the last column) from memory-mapped files.")
    print(text)


if __name__ == "__main__":
    main()
