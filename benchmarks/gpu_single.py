"""One GPU, NCCL at world size 1: our runtime against plain PyTorch on the same model and batch.

    python benchmarks/gpu_single.py            # on a machine with a CUDA GPU
    python benchmarks/gpu_single.py --small    # a tiny version of every section on the CPU (gloo), for a smoke test

Three sections, each written to RESULTS.md:

1. fp32 forward + backward, generated code (plan "dp", world 1, process group on the backend the
   `nnscaler_choose_backend` hook picks: NCCL on a GPU) vs eager, GPT-2 small and a Llama shape.
2. bf16 training steps of a GPT-2 small config: our runtime with `precision="bf16"` and
   `nns.build_optimizer(AdamW)` (bf16 parameters, fp32 masters) vs plain PyTorch under
   `torch.autocast(bfloat16)` with AdamW on fp32 parameters. Step time ratio and peak memory.
3. Lightning, `accelerator="gpu", devices=1, precision="bf16-mixed"`: `strategy="nnscaler"` vs
   Lightning's own single-device strategy, same module and data; median time per training batch.

Steps alternate between the two sides (sections 1 and 2), so clock and thermal drift hit both; peak
memory is measured with each side alone on the device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402


def _on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def fp32_generated_vs_eager(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    rows = []
    cases = (("gpt2 12x768", lambda: common.gpt2(12, 768, 12, vocab=50257, positions=1024), 8, 1024),
             ("llama 8x1024", lambda: common.llama(8, 1024, 16, 8, vocab=32000, positions=1024), 8, 1024))
    if small:
        cases = (("gpt2 2x64", lambda: common.gpt2(2, 64, 4), 2, 32), ("llama 2x64", lambda: common.llama(2, 64, 4, 2), 2, 32))
    for name, build, b, s in cases:
        vocab = build().config.vocab_size if small else (50257 if "gpt2" in name else 32000)
        example = common.batch(b, s, vocab=vocab)  # captured on the CPU; the generated code runs where it is put
        inputs = _on(example, device)
        eager = build().to(device)
        ours = nns.parallelize(build(), example, plan="dp", device=device, cache_dir="/tmp/nns_gpu_cache")

        def eager_step():
            eager(**inputs).loss.backward()
            eager.zero_grad(set_to_none=True)

        def ours_step():
            ours.train_step(inputs)
            ours.zero_grad(set_to_none=True)

        p = common.time_paired(eager_step, ours_step, warmup=3, iters=iters, sync=common.sync_device)
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
        rows.append((name, f"{b}x{s}", backend, f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}", *p.cells()))
        print(rows[-1], flush=True)
        del eager, ours
        common.reset_peak()
    return rows


def bf16_training(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    build = (lambda: common.gpt2(2, 64, 4)) if small else (lambda: common.gpt2(12, 768, 12, vocab=50257, positions=1024))
    b, s = (2, 32) if small else (8, 1024)
    vocab = 2048 if small else 50257
    example = common.batch(b, s, vocab=vocab)
    inputs = _on(example, device)
    lr = 1e-4

    def plain_side():
        model = build().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []

        def step():
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return model, opt, step, losses

    def ours_side():
        pm = nns.parallelize(build(), example, plan="dp", precision="bf16", device=device,
                             cache_dir="/tmp/nns_gpu_cache")
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=lr)
        losses = []

        def step():
            loss = pm.train_step(inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return pm, opt, step, losses

    peaks = {}
    for name, side in (("plain", plain_side), ("ours", ours_side)):  # each alone for its peak memory
        common.reset_peak()
        held = side()
        for _ in range(3):
            held[2]()
        common.sync_device()
        peaks[name] = common.peak_gib()
        del held
    common.reset_peak()
    _, _, plain_step, plain_losses = plain_side()
    _, _, ours_step, ours_losses = ours_side()
    p = common.time_paired(plain_step, ours_step, warmup=3, iters=iters, sync=common.sync_device)
    # Both sides took the same steps from the same weights: their losses agree within bf16's tolerance.
    first_diff = max(abs(float(a) - float(b)) / abs(float(a)) for a, b in zip(plain_losses[:5], ours_losses[:5]))
    row = (f"gpt2 {'2x64' if small else '12x768'} bf16 AdamW", f"{b}x{s}", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}",
           *p.cells(), f"{peaks['plain']:.2f}", f"{peaks['ours']:.2f}", f"{first_diff:.1e}")
    print(row, flush=True)
    return [row]


def lightning_bf16(device: torch.device, small: bool, steps: int) -> list[tuple[str, ...]]:
    import lightning.pytorch as pl

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    b, s = (2, 32) if small else (8, 1024)
    vocab = 2048 if small else 50257

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = common.gpt2(2, 64, 4) if small else common.gpt2(12, 768, 12, vocab=50257, positions=1024)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self):
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, *a):
            common.sync_device()
            self._t = time.perf_counter()

        def on_train_batch_end(self, *a):
            common.sync_device()
            self.times.append(time.perf_counter() - self._t)

    data = torch.randint(0, vocab, (b * steps, s), generator=torch.Generator().manual_seed(0))
    results = {}
    accel = "gpu" if device.type == "cuda" else "cpu"
    for name, strategy in (("lightning", "auto"), ("nnscaler", "nnscaler")):
        common.reset_peak()
        timer = Timer()
        trainer = pl.Trainer(strategy=strategy, accelerator=accel, devices=1, precision="bf16-mixed",
                             max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=b))
        warm = timer.times[3:] or timer.times
        results[name] = (statistics.median(warm), common.peak_gib(), type(trainer.strategy).__name__)
        print(name, results[name], flush=True)
    ratio = results["lightning"][0] / results["nnscaler"][0]
    return [(f"gpt2 {'2x64' if small else '12x768'}", f"{b}x{s}", results["nnscaler"][2],
             f"{results['lightning'][0] * 1e3:.1f}", f"{results['nnscaler'][0] * 1e3:.1f}", f"{ratio:.3f}",
             f"{results['lightning'][1]:.2f}", f"{results['nnscaler'][1]:.2f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny models on whatever device is there (smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md as it is")
    ap.add_argument("--sections", default="fp32,bf16,lightning")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    common.env_world_one()
    sections = args.sections.split(",")
    out = []
    if "fp32" in sections:
        rows = fp32_generated_vs_eager(device, args.small, args.iters)
        out.append(("gpu_single.py: one GPU, NCCL world 1, generated code vs eager (fp32 fwd+bwd)", rows,
                    ("model", "batch", "backend", "eager ms", "generated ms", "ratio eager/generated of the median steps",
                     "median per-step ratio")))
    if "bf16" in sections:
        rows = bf16_training(device, args.small, args.iters)
        out.append(("gpu_single.py: one GPU, bf16 training step, our runtime vs plain PyTorch autocast", rows,
                    ("model", "batch", "plain ms", "ours ms", "ratio plain/ours of the median steps",
                     "median per-step ratio", "plain peak GiB", "ours peak GiB",
                     "max rel loss diff, first 5 steps")))
    if "lightning" in sections:
        if torch.distributed.is_initialized():  # Lightning opens its own process group
            torch.distributed.destroy_process_group()
        rows = lightning_bf16(device, args.small, max(args.iters, 10))
        out.append(("gpu_single.py: Lightning bf16-mixed on one GPU, strategy nnscaler vs Lightning's own", rows,
                    ("model", "batch", "our strategy class", "Lightning ms/batch", "nnscaler ms/batch",
                     "ratio Lightning/nnscaler", "Lightning peak GiB", "nnscaler peak GiB")))
    for title, rows, header in out:
        if args.no_record or args.small:
            print(title, rows)
        else:
            print(common.record(title, rows, header))


if __name__ == "__main__":
    main()
