"""Where a training step's time goes: torch.profiler tables for eager and for our generated code.

    python benchmarks/profile_step.py                    # GPT-2 small shape on the GPU if there is one
    python benchmarks/profile_step.py --model llama --small

Prints the ops that take the most device (or CPU) time on each side, so a gap in
`gpu_single.py` or `generated_vs_eager.py` can be traced to the ops that differ.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: whole AdamW steps, plain autocast vs our precision='bf16' with build_optimizer")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    common.env_world_one()
    if args.small:
        build = (lambda: common.gpt2(2, 64, 4)) if args.model == "gpt2" else (lambda: common.llama(2, 64, 4, 2))
        b, s, vocab = 2, 32, 2048
    elif args.model == "gpt2":
        build, b, s, vocab = (lambda: common.gpt2(12, 768, 12, vocab=50257, positions=1024)), 8, 1024, 50257
    else:
        build, b, s, vocab = (lambda: common.llama(8, 1024, 16, 8, vocab=32000, positions=1024)), 8, 1024, 32000
    example = common.batch(b, s, vocab=vocab)
    inputs = {k: v.to(device) for k, v in example.items()}
    eager = build().to(device)
    ours = nns.parallelize(build(), example, plan="dp", device=device, cache_dir="/tmp/nns_profile_cache",
                           precision=args.precision)
    print("generated code:", ours.source_path)
    bf16 = args.precision == "bf16"
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4) if bf16 else None
    ours_opt = nns.build_optimizer(ours, torch.optim.AdamW, lr=1e-4) if bf16 else None

    def eager_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = eager(**inputs).loss
        loss.backward()
        if eager_opt is not None:
            eager_opt.step()
        eager.zero_grad(set_to_none=True)

    def ours_step():
        ours.train_step(inputs)
        if ours_opt is not None:
            ours_opt.step()
        ours.zero_grad(set_to_none=True)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    for name, step in (("eager", eager_step), ("generated", ours_step)):
        for _ in range(3):
            step()
        common.sync_device()
        with profile(activities=acts) as prof:
            for _ in range(3):
                step()
            common.sync_device()
        print(f"==== {name} (3 steps)")
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
