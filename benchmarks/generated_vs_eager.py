"""Generated single-process code vs plain eager PyTorch on the same model (forward + backward).

    python benchmarks/generated_vs_eager.py

Target: generated throughput >= 0.97 of eager. Both run in this process, alternating step by step, on
the same weights and batch; the ratio is eager's median step time / generated's (higher is
better for us), with the median per-step ratio beside it.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
import common  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, build, b, s in (("gpt2 4x256", common.gpt2, 8, 128), ("llama 4x256", common.llama, 8, 128)):
        eager = build()
        ours_model = build()
        inputs = common.batch(b, s)
        pm = nns.parallelize(ours_model, inputs, plan="dp", cache_dir="/tmp/nns_bench_cache")

        def eager_step():
            eager(**inputs).loss.backward()
            eager.zero_grad(set_to_none=True)

        def ours_step():
            pm.train_step(inputs)
            pm.zero_grad(set_to_none=True)

        p = common.time_paired(eager_step, ours_step, iters=20)
        rows.append((name, f"{b}x{s}", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}", *p.cells()))
        print(rows[-1], flush=True)
    print(common.record("generated_vs_eager.py: one process, generated code vs eager (fwd+bwd step)", rows,
                        ("model", "batch", "eager ms", "generated ms", "ratio eager/generated of the median steps (target >= 0.97)",
                         "median per-step ratio")))


if __name__ == "__main__":
    main()
