"""How long a fault costs: from a hung collective to its report, and from a killed rank to training
again, under tp and zero3, 2 gloo processes under torchrun.

    python benchmarks/faults.py                 # tp and zero3, 3 repeats each
    python benchmarks/faults.py --repeats 1 --plans tp

Each run is tests/fault_job.py (recipes/resilient_train.py with one fault injected into the processes
it starts) under `torchrun --max-restarts`:

- hang: rank 1 sleeps inside a forward; the time measured is from the moment it starts sleeping to
  the moment the waiting rank's watchdog has written its report (the report's `unix_time`), with
  the plan's `collective_timeout_s` given beside it: what is left beyond the timeout is the
  watchdog's own latency.
- kill: a seeded rank SIGKILLs itself after a seeded step; the time measured is from the kill to
  the first completed step after torchrun restarted the workers (their start, the plan, the
  compile, loading the latest checkpoint and one step).

The medians over the repeats are written to RESULTS.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "fault_job.py")


def launch(work: str, scenarios: list[str], timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "--monitor-interval", "0.5", JOB, "--work", work,
           "--cache-dir", os.path.join(work, "cache"), "--scenarios", ",".join(scenarios),
           "--micro-batch-size", "2", "--collective-timeout", str(timeout_s)]
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    return p.returncode, p.stdout + p.stderr


def events(out: str) -> list[dict]:
    return [json.loads(line.split("[fault] ", 1)[1]) for line in out.splitlines() if "[fault] " in line]


def one_run(plan: str, timeout_s: float) -> tuple[float, float]:
    """(seconds from the stall to the hang report, seconds from the kill to a completed step)."""
    with tempfile.TemporaryDirectory(prefix="nns-faults-") as work:
        code, out = launch(work, [f"{plan}:stall", f"{plan}:kill"], timeout_s)
        if code != 0:
            raise SystemExit(f"the fault job failed (exit {code}):\n{out[-4000:]}")
        name = f"{plan}-stall"
        report = sorted(glob.glob(os.path.join(work, name, "reports", "hang-*.json")))[0]
        with open(report) as f:
            reported = json.load(f)["unix_time"]
        with open(os.path.join(work, f"fault-{name}.json")) as f:
            stalled = json.load(f)["time"]
        again = [e["seconds"] for e in events(out) if e["event"] == "training again" and e["scenario"] == f"{plan}-kill"]
        return reported - stalled, again[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="tp,zero3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=4.0, help="the plan's collective_timeout_s")
    args = ap.parse_args(argv)
    rows = []
    for plan in args.plans.split(","):
        hang, kill = [], []
        for i in range(args.repeats):
            h, k = one_run(plan, args.timeout)
            hang.append(h), kill.append(k)
            print(f"{plan} run {i + 1}: hang reported after {h:.1f} s (timeout {args.timeout:g} s), "
                  f"training again {k:.1f} s after the kill", flush=True)
        rows.append((plan, f"{args.timeout:g}", f"{statistics.median(hang):.1f}",
                     f"{statistics.median(hang) - args.timeout:.1f}", f"{statistics.median(kill):.1f}",
                     str(args.repeats)))
    print(common.record(
        "faults.py: time from a hang to its report, from a kill to training again, 2 gloo processes under torchrun",
        rows, ("plan", "collective_timeout_s", "hang -> report (s, median)", "beyond the timeout (s)",
               "kill -> next step done (s, median)", "runs"),
        notes="A residual MLP (recipes/resilient_train.py) with one fault per run (tests/fault_job.py). "
              "Kill -> next step covers torchrun noticing the dead process, the restart of both workers, "
              "planning and generating the program again (cached), loading the latest checkpoint and one step; "
              "on 2 CPU cores most of it is the workers' Python start-up and imports."))


if __name__ == "__main__":
    main()
