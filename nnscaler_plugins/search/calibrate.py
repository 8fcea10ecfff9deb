"""The `local-cpu` cluster: this machine, measured.

A device is one process. What the cost model needs is measured once and cached in a small JSON file
(keyed by host, core count and torch version), so every process of a job reads the same numbers and
the search stays deterministic across ranks:

- matmul throughput of one thread (fp32), from square matmuls of a transformer-ish size;
- memory bandwidth of one thread, from copying a tensor much larger than the caches;
- the fixed cost of one small op as generated code runs it in training (called through
  `torch.ops.aten`, recorded by autograd, and its backward node), and of one view op, from chains
  of tiny ops;
- a kernel table of this machine (`search/kernel_tables.py`): matmul throughput at a few GEMM shapes
  (small m, n or k lose to operand packing) and element-wise throughput at a few sizes (small tensors
  stay in cache, large ones stream from DRAM), with the curves fitted to them;
- gloo bandwidth and latency between two local processes, from all-reduces of 4 KiB to 16 MiB
  fitted to the alpha-beta model t = 2 alpha + M / beta (two ranks, ring).

Devices share the cores: with `devices` processes on `cores` cores each process gets
max(1, cores // devices) threads and, when there are more processes than cores, a share
cores / devices of one core's throughput. The gloo measurement runs in two child processes started
with `subprocess` (not multiprocessing), so it also works from inside daemonic worker processes.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Optional

from nnscaler_plugins.progress import Progress
from nnscaler_plugins.search.cluster_spec import ClusterSpec, Link
from nnscaler_plugins.search.efficiency import Efficiency
from nnscaler_plugins.search.kernel_tables import KernelTable, MatmulCurve, cached

FORMAT = 3  # 3: gloo timed as the fastest of several batches (2 averaged one batch); training op overheads
# GEMM shapes (m, n, k) and element-wise sizes (float32 elements) the table is measured at: the range of
# the small models planned and run on CPUs (tokens per micro-batch x hidden sizes of a few hundred).
MATMUL_SHAPES = ((64, 256, 256), (128, 256, 256), (128, 1024, 256), (512, 256, 256), (512, 1024, 256),
                 (512, 256, 1024), (1024, 1024, 256), (256, 64, 128), (256, 256, 32))
ELEMENTWISE_SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
# Used when measure=False: a slow but typical core (about a 2.5 GHz AVX2 core).
DEFAULTS = {"matmul_flops": 50e9, "memory_bandwidth": 5e9, "op_overhead_s": 8e-6,
            "gloo_bandwidth": 1.0e9, "gloo_latency": 60e-6, "memory_bytes": 8 * 1024 ** 3}


def cache_path(cache_dir: Optional[str]) -> str:
    """Where this machine's measured tables are kept (per torch version and thread count)."""
    import torch

    d = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "nnscaler-plugins")
    key = f"{socket.gethostname()}|{os.cpu_count()}|{platform.machine()}|{torch.__version__}|{FORMAT}"
    return os.path.join(d, f"local-cpu-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json")


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _best_time(fn, repeat: int) -> float:
    """The fastest of `repeat` runs: what the machine can do when the other processes let it (under
    load from other jobs the median measures them, not this machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_compute() -> dict:
    """Single-thread matmul FLOP/s, memory bandwidth and per-op overhead of this process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        t = _best_time(lambda: a @ b, 15)
        flops = 2 * n ** 3 / t
        x = torch.randn(16 * 1024 * 1024)  # 64 MiB
        y = torch.empty_like(x)
        y.copy_(x)
        t = _best_time(lambda: y.copy_(x), 7)
        bandwidth = 2 * x.numel() * 4 / t
        s1, s2 = torch.ones(4), torch.ones(4)
        for _ in range(100):
            torch.add(s1, s2)
        t = _median_time(lambda: [torch.add(s1, s2) for _ in range(200)], 7) / 200
        op_fwd, op_bwd = _training_overhead(lambda y: torch.ops.aten.add.Tensor(y, s2))
        view_fwd, view_bwd = _training_overhead(lambda y: torch.ops.aten.view.default(y, [4]))
        mm_points = []
        for m, n, k in MATMUL_SHAPES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b
            reps = max(1, int(2e8 // (2 * m * n * k)))
            dt = _best_time(lambda: [a @ b for _ in range(reps)], 7) / reps
            mm_points.append((m, n, k, 2 * m * n * k / max(dt - t, 1e-9)))
        ew_points = []
        for size in ELEMENTWISE_SIZES:
            u, v = torch.randn(size), torch.randn(size)
            out = torch.empty(size)
            torch.add(u, v, out=out)
            reps = max(1, int(8e6 // size))
            dt = _best_time(lambda: [torch.add(u, v, out=out) for _ in range(reps)], 7) / reps
            ew_points.append((3 * size * 4, 3 * size * 4 / max(dt - t, 1e-9)))
        return {"matmul_flops": flops, "memory_bandwidth": bandwidth, "op_overhead_s": t,
                "train_op_overhead_s": (op_fwd, op_bwd), "view_overhead_s": (view_fwd, view_bwd),
                "matmul_points": mm_points, "elementwise_points": ew_points}
    finally:
        torch.set_num_threads(threads)


def _training_overhead(op, n: int = 200) -> tuple[float, float]:
    """(forward, backward) seconds of one tiny op in a chain recorded by autograd, the fastest of
    several chains: what a training step pays per op beyond its arithmetic."""
    import torch

    x = torch.ones(4, requires_grad=True)

    def forward():
        y = x
        for _ in range(n):
            y = op(y)
        return y

    def both():
        forward().sum().backward()

    forward()
    both()
    fwd = _best_time(forward, 9) / n
    total = _best_time(both, 9) / n
    return fwd, max(total - fwd, 0.0)


def _gloo_child(rank: int, port: int) -> None:
    """One of the two processes measuring gloo (run as `python -m ... gloo RANK PORT`)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for size in (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 20, 1 << 21, 1 << 22):  # float32 elements
        x = torch.ones(size)
        for _ in range(2):
            dist.all_reduce(x)
        reps = 5 if size <= 1 << 17 else 2
        best = float("inf")
        for _ in range(7):  # the fastest batch: a process preempted by other jobs measures them, not gloo
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            took = torch.tensor([(time.perf_counter() - t) / reps])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # both ranks agree on each batch's time
            best = min(best, float(took.item()))
        rows.append((size * 4, best))
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


# How long the two gloo processes may take (about 10 s on a quiet 2-core machine); past it the preset
# figures are used (`measurements`), never a failed plan.
GLOO_TIMEOUT_S = 120.0


class MeasurementFailed(RuntimeError):
    """Measuring the machine did not finish (it took longer than allowed, or a child process failed)."""


def measure_gloo(timeout: float = GLOO_TIMEOUT_S) -> dict:
    """Fit t = 2 alpha + M / beta to two-process gloo all-reduces. MeasurementFailed when the two
    processes take longer than `timeout` seconds together (they are killed) or fail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "nnscaler_plugins.search.calibrate", "gloo"]
    procs = [subprocess.Popen(cmd + [str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for r in range(2)]
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        raise MeasurementFailed(f"measuring gloo between 2 local processes took longer than {timeout:g} s "
                                "(a busy machine)") from None
    if any(p.returncode for p in procs):
        raise MeasurementFailed(f"measuring gloo failed: {outs[0][1][-2000:]} {outs[1][1][-2000:]}")
    rows = json.loads(outs[0][0].strip().splitlines()[-1])
    # Two cores shared by two busy processes make single samples noisy: latency comes from the
    # smallest messages, bandwidth from the median over the largest ones once latency is taken off.
    alpha = min(t for _, t in rows[:2]) / 2
    big = sorted(rows)[-3:]
    beta = statistics.median(m / max(t - 2 * alpha, 1e-9) for m, t in big)
    return {"gloo_bandwidth": beta, "gloo_latency": alpha, "gloo_samples": rows}


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(DEFAULTS["memory_bytes"])


def measurements(measure: bool = True, cache_dir: Optional[str] = None,
                 gloo_timeout_s: float = GLOO_TIMEOUT_S) -> dict:
    """This machine's numbers: from the cache file, or measured now (under a file lock) and cached.
    Measuring gloo that takes longer than `gloo_timeout_s` (a busy machine) or fails does not fail:
    the preset gloo figures are used and cached, with a warning that says so and how to measure
    again (`gloo_preset` in the file holds why)."""
    if not measure:
        return dict(DEFAULTS, cores=os.cpu_count() or 1, memory_bytes=_physical_memory(), measured=False)
    path = cache_path(cache_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others wait and read its file
        try:
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            # a first run waits here for several seconds: say what is being measured, and for how long
            bar = Progress("measuring this machine for the local-cpu cluster", 2, delay_s=0.0, always=True)
            bar.set("matmul, memory bandwidth and per-op overhead of one thread")
            data = measure_compute()
            bar.step()
            bar.set("gloo all-reduces between 2 local processes")
            try:
                data.update(measure_gloo(gloo_timeout_s))
            except MeasurementFailed as e:
                data.update(gloo_bandwidth=DEFAULTS["gloo_bandwidth"], gloo_latency=DEFAULTS["gloo_latency"],
                            gloo_preset=str(e))
                import warnings

                warnings.warn(f"{e}; the local-cpu cluster uses the preset gloo figures instead (bandwidth "
                              f"{DEFAULTS['gloo_bandwidth'] / 1e9:g} GB/s, latency {DEFAULTS['gloo_latency'] * 1e6:g} "
                              f"us), cached in {path}: delete that file to measure again", stacklevel=2)
            bar.step()
            bar.close(f"cached in {path}")
            data.update(cores=os.cpu_count() or 1, memory_bytes=_physical_memory(), measured=True,
                        host=socket.gethostname(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
            return data
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fit_table(m: dict) -> Optional[KernelTable]:
    """This machine's kernel table from the measured points: the matmul curve (peak fraction, k_half,
    mn_half, cache speed-up) and the element-wise curve (fraction of the copy bandwidth, cache speed-up)
    that fit them best, with one cache size for both (grid search on the log error; a handful of points,
    so a coarse grid is enough)."""
    mm, ew = m.get("matmul_points"), m.get("elementwise_points")
    if not mm or not ew:
        return None
    peak, bw = float(m["matmul_flops"]), float(m["memory_bandwidth"])

    def fitted(logs_of):
        logs = logs_of()
        scale = math.exp(statistics.mean(logs))
        return statistics.mean((x - math.log(scale)) ** 2 for x in logs), scale

    best = None
    for cache in (2.5e5, 5e5, 1e6, 2e6, 4e6, 8e6, 16e6):  # one cache size for both fits
        mem = min((fitted(lambda: [math.log(r / bw / cached(sp, b, cache)) for b, r in ew]) + (sp,)
                   for sp in (1.0, 1.5, 2.0, 3.0, 4.0)), key=lambda x: x[0])
        for mm_speed in (1.0, 1.5, 2.0, 3.0):
            for k_half in (0.0, 16.0, 64.0, 256.0):
                for mn_half in (0.0, 8.0, 32.0, 128.0):
                    c = MatmulCurve(1.0, k_half, 1, 1, mn_half, mm_speed)
                    mm_err, pf = fitted(lambda: [math.log(f / peak / c.efficiency(a, n, k, 1, 1, cache))
                                                 for a, n, k, f in mm])
                    if best is None or mm_err + mem[0] < best[0]:
                        best = (mm_err + mem[0], replace(c, peak_fraction=pf), mem[1], cache, mem[2])
    _, curve, frac, cache, mem_speed = best
    points = tuple({"kind": "matmul", "m": a, "n": b, "k": c, "batch": 1, "dtype": "fp32", "efficiency": f / peak,
                    "source": "measured"} for a, b, c, f in mm) + \
        tuple({"kind": "memory", "bytes": b, "efficiency": r / bw, "source": "measured"} for b, r in ew)
    return KernelTable(device="cpu", sms=1, matmul={"fp32": curve, "bf16": curve}, memory_fraction=frac,
                       memory_bytes_half=0.0, cache_bytes=cache, cache_speedup=mem_speed,
                       sources=("measured by nnscaler_plugins/search/calibrate.py",),
                       points=points, measured=str(m.get("date", "")))


def _per_op(m: dict, key: str, default: float) -> float:
    """Mean of a measured (forward, backward) per-op cost: the cost model adds one per pass."""
    v = m.get(key)
    return default if v is None else (float(v[0]) + float(v[1])) / 2


def local_cpu(devices: Optional[int] = None, measure: bool = True, cache_dir: Optional[str] = None) -> ClusterSpec:
    """This machine as a one-node cluster of `devices` processes (default: one per core)."""
    m = measurements(measure, cache_dir)
    cores = int(m.get("cores") or 1)
    devices = int(devices or cores)
    share = min(1.0, cores / devices) * max(1, cores // devices)  # threads per process, or a share of one core
    return ClusterSpec(
        name="local-cpu", nodes=1, devices_per_node=devices, device=f"cpu process ({share:g} core)",
        peak_flops={"fp32": m["matmul_flops"] * share, "bf16": m["matmul_flops"] * share / 4},
        memory_bytes=float(m["memory_bytes"]) / devices, memory_bandwidth=m["memory_bandwidth"] * share,
        intra_node=Link("gloo-loopback", m["gloo_bandwidth"], m["gloo_latency"]),
        inter_node=Link("gloo-tcp", m["gloo_bandwidth"], m["gloo_latency"]),
        dtype="fp32", efficiency=Efficiency(matmul=1.0, memory=1.0, network=1.0,
                                            op_overhead_s=_per_op(m, "train_op_overhead_s", m["op_overhead_s"]),
                                            view_overhead_s=_per_op(m, "view_overhead_s", 0.0),
                                            overlap_slowdown=1.0, fused_elementwise=False, comm_overlap=False),
        notes=("measured on " + str(m.get("host", "this machine")) + " " + str(m.get("date", ""))
               + (f"; gloo figures preset ({m['gloo_preset']})" if m.get("gloo_preset") else ""))
        if m.get("measured") else "defaults, not measured (measure=False)",
        kernels=fit_table(m) if m.get("measured") else None)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "gloo":
        _gloo_child(int(argv[1]), int(argv[2]))
        return 0
    print(json.dumps(measurements(cache_dir=argv[0] if argv else None), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
