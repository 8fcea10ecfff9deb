"""The `local-cpu` cluster: this machine, measured.

A device is one process. What the cost model needs is measured once and cached in a small JSON file
(keyed by host, core count and torch version), so every process of a job reads the same numbers and
the search stays deterministic across ranks:

- matmul throughput of one thread (fp32), from square matmuls of a transformer-ish size;
- memory bandwidth of one thread, from copying a tensor much larger than the caches;
- the fixed cost of one small op (dispatch overhead), from adding tiny tensors;
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
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

from nnscaler_plugins.progress import Progress
from nnscaler_plugins.search.cluster_spec import ClusterSpec, Link
from nnscaler_plugins.search.efficiency import Efficiency

FORMAT = 1
# Used when measure=False: a slow but typical core (about a 2.5 GHz AVX2 core).
DEFAULTS = {"matmul_flops": 50e9, "memory_bandwidth": 5e9, "op_overhead_s": 8e-6,
            "gloo_bandwidth": 1.0e9, "gloo_latency": 60e-6, "memory_bytes": 8 * 1024 ** 3}


def _cache_path(cache_dir: Optional[str]) -> str:
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
        t = _median_time(lambda: a @ b, 15)
        flops = 2 * n ** 3 / t
        x = torch.randn(16 * 1024 * 1024)  # 64 MiB
        y = torch.empty_like(x)
        y.copy_(x)
        t = _median_time(lambda: y.copy_(x), 7)
        bandwidth = 2 * x.numel() * 4 / t
        s1, s2 = torch.ones(4), torch.ones(4)
        for _ in range(100):
            torch.add(s1, s2)
        t = _median_time(lambda: [torch.add(s1, s2) for _ in range(200)], 7) / 200
        return {"matmul_flops": flops, "memory_bandwidth": bandwidth, "op_overhead_s": t}
    finally:
        torch.set_num_threads(threads)


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
        reps = 20 if size <= 1 << 17 else 8
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        rows.append((size * 4, (time.perf_counter() - t) / reps))
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def measure_gloo(timeout: float = 120.0) -> dict:
    """Fit t = 2 alpha + M / beta to two-process gloo all-reduces."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "nnscaler_plugins.search.calibrate", "gloo"]
    procs = [subprocess.Popen(cmd + [str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"measuring gloo failed: {outs[0][1][-2000:]} {outs[1][1][-2000:]}")
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


def measurements(measure: bool = True, cache_dir: Optional[str] = None) -> dict:
    """This machine's numbers: from the cache file, or measured now (under a file lock) and cached."""
    if not measure:
        return dict(DEFAULTS, cores=os.cpu_count() or 1, memory_bytes=_physical_memory(), measured=False)
    path = _cache_path(cache_dir)
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
            data.update(measure_gloo())
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
                                            op_overhead_s=m["op_overhead_s"], overlap_slowdown=1.0,
                                            fused_elementwise=False, comm_overlap=False),
        notes=("measured on " + str(m.get("host", "this machine")) + " " + str(m.get("date", "")))
        if m.get("measured") else "defaults, not measured (measure=False)")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "gloo":
        _gloo_child(int(argv[1]), int(argv[2]))
        return 0
    print(json.dumps(measurements(cache_dir=argv[0] if argv else None), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
