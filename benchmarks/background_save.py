"""Training with a checkpoint every 10 steps: `nns.checkpoint.save(..., background=True)` vs no saves
(and vs the blocking save), one process.

    python benchmarks/background_save.py            # GPT-2 4x256, batch 8x128, AdamW, 8 window pairs

A window is 10 training steps (train_step + AdamW step). The saving window starts a save of the
model and optimizer state at its first step and, for the background save, waits for it after its
tenth (so a write longer than the window is counted, not hidden in the next one). Windows alternate
with the no-save windows (benchmarks/common.time_paired); the ratio reported is the ratio of the
median window times (no save / background), the median of per-pair ratios beside it; the target is
>= 0.95 (within 5 % of no saves). Training runs with one torch
thread, as a rank does beside its device; the writer thread takes the other core.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = common.gpt2(n_layer=4, n_embd=256, n_head=8)
    batch = common.batch(8, 128)
    pm = nns.parallelize(model, batch, plan="dp", cache_dir=os.path.join(tempfile.gettempdir(), "nns_bench_cache"))
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    root = tempfile.mkdtemp(prefix="nns-bench-save-")
    state_bytes = sum(t.numel() * t.element_size() for t in pm.state_dict().values()) * 3  # weights + 2 Adam moments

    def steps() -> None:
        for _ in range(args.every):
            pm.train_step(batch)
            opt.step()
            opt.zero_grad()

    def plain() -> None:
        steps()

    def background() -> None:
        handle = nns.checkpoint.save(os.path.join(root, "bg"), pm, opt, background=True, step=0)
        steps()
        handle.wait()

    def blocking() -> None:
        nns.checkpoint.save(os.path.join(root, "sync"), pm, opt, step=0)
        steps()

    try:
        bg = common.time_paired(plain, background, warmup=1, iters=2 * args.pairs)
        sync = common.time_paired(plain, blocking, warmup=1, iters=2 * args.pairs)
        a, b, ratio_bg, a2, c, ratio_sync = bg.a, bg.b, bg.per_step, sync.a, sync.b, sync.per_step
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [("gpt2 4x256, AdamW", "8x128", f"{state_bytes / 2**20:.0f}", f"{a * 1000 / args.every:.1f}",
             f"{b * 1000 / args.every:.1f}", f"{a / b:.3f} ({ratio_bg:.3f})", f"{c * 1000 / args.every:.1f}",
             f"{a2 / c:.3f} ({ratio_sync:.3f})")]
    header = ("model", "batch", "state MiB", "no save ms/step", "background ms/step",
              "none/background, ratio of medians (median per-pair) (target >= 0.95)", "blocking ms/step",
              "none/blocking, ratio of medians (median per-pair)")
    for r in rows:
        print(dict(zip(header, r)))
    if not args.no_record:
        print(common.record(f"background_save.py: a checkpoint every {args.every} steps, background vs none (one "
                            "process, one torch thread)", rows, header,
                            notes="Each window is 10 steps; the saving window starts the save at its first step and "
                                  "(background) waits for it after its last. The blocking save is the same save "
                                  "without background=True."))


if __name__ == "__main__":
    main()
