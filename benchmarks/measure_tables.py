"""Measure a kernel table (nnscaler_plugins/search/kernel_tables.py) on the GPU this runs on.

The shipped tables (search/tables/*.json) come from public figures; on a GPU this script measures the
same kinds of points and fits the same curves, and writes a table with the date, device and software
versions, ready to replace the shipped one (or to be named by a cluster file's `kernels:` path):

- matmul: torch.matmul in each dtype at square and transformer shapes (short K as attention scores,
  narrow N as tensor-parallel pieces), CUDA-event timed, launch cost included as the cost model has it;
- attention: F.scaled_dot_product_attention forward and forward + backward, per backend available
  (flash: "flash2" class; cuDNN: "flash3" class on Hopper), over sequence lengths and head sizes,
  causal and not;
- memory: an element-wise add over tensors of a few sizes, bytes moved / time against the datasheet
  bandwidth given with --bandwidth (or the copy bandwidth measured here when not given).

    python benchmarks/measure_tables.py --out nnscaler_plugins/search/tables/h100.json --peak-bf16 989e12 \\
        --bandwidth 3.35e12
    python benchmarks/measure_tables.py --quick     # a smaller grid (about a minute)

Without a GPU it says so and exits: CPUs are measured by `python -m nnscaler_plugins.search.calibrate`.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch


def _time_cuda(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def measure_matmul(dtype: torch.dtype, quick: bool) -> list[tuple[int, int, int, float]]:
    sizes = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
             (8192, 8192, 128), (8192, 8192, 512), (8192, 8192, 2048), (2048, 1536, 12288), (16384, 4096, 4096),
             (16384, 512, 4096), (4096, 128, 4096), (512, 512, 8192)]
    if quick:
        sizes = sizes[::2]
    out = []
    for m, n, k in sizes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        t = _time_cuda(lambda: a @ b, max(3, int(2e12 // (2 * m * n * k))))
        out.append((m, n, k, 2 * m * n * k / t))
    return out


def measure_attention(quick: bool) -> dict[str, list[tuple[int, int, bool, float, float]]]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash2": SDPBackend.FLASH_ATTENTION, "flash3": SDPBackend.CUDNN_ATTENTION}
    seqs = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    heads = (64, 128) if quick else (64, 128, 256)
    out: dict[str, list] = {}
    for name, backend in backends.items():
        rows = []
        for s in seqs:
            for d in heads:
                for causal in (False, True):
                    b, h = max(1, 16384 // s), max(1, 2048 // d)
                    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    flops = 4 * b * h * s * s * d  # the whole score matrix, as the cost model counts
                    try:
                        with sdpa_kernel(backend):
                            fwd = _time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 5)
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            g = torch.randn_like(o)
                            both = _time_cuda(lambda: torch.autograd.grad(
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), g), 3)
                    except RuntimeError:
                        continue
                    rows.append((s, d, causal, flops / fwd, 2 * flops / max(both - fwd, 1e-9)))
        if rows:
            out[name] = rows
    return out


def measure_memory(quick: bool) -> list[tuple[float, float]]:
    out = []
    for n in ((1 << 16, 1 << 22, 1 << 26) if quick else (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)):
        x, y = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(x)
        t = _time_cuda(lambda: torch.add(x, y, out=z), 20)
        out.append((3 * n * 2, 3 * n * 2 / t))
    return out


def _fit_scale(logs: list[float]) -> tuple[float, float]:
    scale = statistics.mean(logs)
    return math.exp(scale), statistics.mean((x - scale) ** 2 for x in logs)


def fit(peak: dict[str, float], bandwidth: float, sms: int, mm: dict, att: dict, mem: list) -> dict:
    from nnscaler_plugins.search.kernel_tables import AttentionCurve, MatmulCurve

    table: dict = {"matmul": {}, "attention": {}, "points": []}
    for dtype, rows in mm.items():
        best = None
        for tile_n in (128, 256):
            for k_half in (32, 64, 96, 128, 160, 256, 384):
                c = MatmulCurve(1.0, k_half, 128, tile_n)
                pf, err = _fit_scale([math.log(f / peak[dtype] / c.efficiency(m, n, k, 1, sms)) for m, n, k, f in rows])
                if best is None or err < best[0]:
                    best = (err, dict(peak_fraction=pf, k_half=k_half, tile_m=128, tile_n=tile_n))
        table["matmul"][dtype] = best[1]
        table["points"] += [{"kind": "matmul", "m": m, "n": n, "k": k, "batch": 1, "dtype": dtype,
                             "efficiency": f / peak[dtype], "source": "measured"} for m, n, k, f in rows]
    for kernel, rows in att.items():
        best = None
        for s_half in (64, 128, 256, 512, 1024):
            for d_half in (8, 16, 24, 32, 48, 64):
                c = AttentionCurve(1.0, 1.0, s_half, d_half, 1.0)
                plain = [r for r in rows if not r[2]]
                fwd, e1 = _fit_scale([math.log(f / peak["bf16"] / c.efficiency(s, d, False, False)) for s, d, _, f, _ in plain])
                bwd, e2 = _fit_scale([math.log(b / peak["bf16"] / c.efficiency(s, d, True, False)) for s, d, _, _, b in plain])
                if best is None or e1 + e2 < best[0]:
                    best = (e1 + e2, fwd, bwd, s_half, d_half)
        _, fwd, bwd, s_half, d_half = best
        causal = [r for r in rows if r[2]]
        base = AttentionCurve(fwd, bwd, s_half, d_half, 1.0)
        # a causal kernel computes half the score matrix: its own efficiency is f / 2 against the curve's
        cf = statistics.mean(f / 2 / peak["bf16"] / base.efficiency(s, d, False, False) for s, d, _, f, _ in causal) \
            if causal else 0.9
        table["attention"][kernel] = dict(forward=fwd, backward=bwd, s_half=s_half, d_half=d_half, causal_fraction=cf)
        for s, d, c_, f, b in rows:
            # the rates count the whole score matrix; a causal kernel computes half of it
            table["points"] += [{"kind": "attention", "kernel": kernel, "seq": s, "head_dim": d, "causal": c_,
                                 "direction": "forward", "efficiency": f / peak["bf16"] / (2 if c_ else 1),
                                 "source": "measured"},
                                {"kind": "attention", "kernel": kernel, "seq": s, "head_dim": d, "causal": c_,
                                 "direction": "backward", "efficiency": b / peak["bf16"] / (2 if c_ else 1),
                                 "source": "measured"}]
    best = None
    for half in (1e4, 1e5, 3e5, 1e6, 3e6, 1e7):
        frac, err = _fit_scale([math.log(r / bandwidth / (b / (b + half))) for b, r in mem])
        if best is None or err < best[0]:
            best = (err, frac, half)
    table["memory"] = {"peak_fraction": best[1], "bytes_half": best[2]}
    table["points"] += [{"kind": "memory", "bytes": b, "efficiency": r / bandwidth, "source": "measured"} for b, r in mem]
    return table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="measured_table.json")
    ap.add_argument("--peak-bf16", type=float, required=False, help="datasheet dense BF16 FLOP/s")
    ap.add_argument("--bandwidth", type=float, default=0.0, help="datasheet memory bandwidth, bytes/s")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU here: the shipped tables stay as they are (CPUs: python -m nnscaler_plugins.search.calibrate)")
        return 1
    props = torch.cuda.get_device_properties(0)
    peak_bf16 = args.peak_bf16 or float(input("datasheet dense BF16 FLOP/s of this GPU: "))
    peak = {"bf16": peak_bf16, "fp16": peak_bf16}
    t0 = time.time()
    mm = {"bf16": measure_matmul(torch.bfloat16, args.quick)}
    att = measure_attention(args.quick)
    mem = measure_memory(args.quick)
    bandwidth = args.bandwidth or max(r for _, r in mem) / 0.9
    table = fit(peak, bandwidth, props.multi_processor_count, mm, att, mem)
    table = {"device": props.name, "sms": props.multi_processor_count, **table,
             "measured": f"{time.strftime('%Y-%m-%d')} on {props.name}, torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, {platform.node()}",
             "sources": [f"measured by benchmarks/measure_tables.py in {time.time() - t0:.0f} s; peak {peak_bf16:.4g} "
                         f"FLOP/s and bandwidth {bandwidth:.4g} B/s as given"]}
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
