"""Fault scenarios for tests/test_faults.py and benchmarks/faults.py: recipes/resilient_train.py run
under torchrun, with one fault injected into the processes this script starts.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 3 tests/fault_job.py \
        --work DIR --scenarios tp:kill,zero3:savekill [recipe options]

Scenarios run in order, each `PLAN:FAULT` with its own checkpoint folder DIR/PLAN-FAULT; a scenario
whose final weights are written is skipped after a restart, and each plan's reference (the same
recipe, no fault) runs once, first. Faults happen once (a marker file in DIR remembers them):

- kill: a seeded random rank SIGKILLs itself after a seeded random step;
- savekill: a rank SIGKILLs itself in the middle of writing a background save (after its first piece);
- stall: rank 1 sleeps inside the forward of a step (a custom autograd Function in the model), so the
  other rank waits in a collective until its watchdog reports and ends it.

Each line this script prints starts with "[fault]" and is JSON after it, for the tests to read.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, os.path.join(ROOT, "recipes")) if p not in sys.path]

import resilient_train as recipe  # noqa: E402

STALL = {"on": False, "seconds": 0.0}


class Stall(torch.autograd.Function):
    """Identity; sleeps in forward while STALL says so (the stalled rank's step)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        if STALL["on"]:
            STALL["on"] = False
            time.sleep(STALL["seconds"])
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class StallNet(recipe.Net):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = Stall.apply(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.head(h), labels)


def stall_model(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return StallNet(dropout=dropout)


def say(**what: Any) -> None:
    print("[fault] " + json.dumps(what), flush=True)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def marker(work: str, name: str) -> str:
    return os.path.join(work, f"fault-{name}.json")


def mark(path: str, **what: Any) -> None:
    tmp = path + f".{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"time": time.time(), **what}, f)
    os.replace(tmp, path)


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run_scenario(work: str, plan: str, fault: str, rest: list[str], seed: int, steps: int, save_every: int,
                 work_tag: str = "", final_tag: str = "") -> None:
    name = f"{plan}-{fault}{work_tag}"
    out = os.path.join(work, f"{name}{final_tag}.pt")
    if os.path.exists(out):
        return
    root = os.path.join(work, name)
    argv = ["--root", root, "--plan", plan, "--out", out, "--steps", str(steps), "--save-every", str(save_every)] + rest
    rng = random.Random(f"{seed}/{name}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fault_step = rng.randrange(2, steps - 1)
    fault_rank = rng.randrange(world)
    done = marker(work, name)
    model_fn = recipe.build_model
    back = {"after": None}

    def on_start(first: int, pm: Any) -> None:
        mesh = pm.plan.mesh
        if rank() == 0:
            inner = [a for a in ("tp", "cp") if a in mesh.names]
            say(event="mesh", scenario=name, axes=mesh.axes, devices_per_node=mesh.devices_per_node,
                nodes=[mesh.node_of(r) for r in range(mesh.world_size)],
                inner_within_node=mesh.within_node(inner) if inner else None,
                dp_across_nodes=mesh.within_node(["dp"]) if "dp" in mesh.names else None)
        if os.path.exists(done):
            with open(done) as f:
                back["after"] = json.load(f)["time"]
            if rank() == 0:
                say(event="resumed", scenario=name, step=first,
                    leftovers=sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, ".*"))))

    def on_step(step: int, pm: Any, opt: Any) -> None:
        if back["after"] is not None:
            if rank() == 0:
                say(event="training again", scenario=name, step=step, seconds=time.time() - back["after"])
            back["after"] = None
        if os.path.exists(done):
            return
        if fault == "kill" and step == fault_step and rank() == fault_rank:
            mark(done, step=step, rank=fault_rank)
            say(event="kill", scenario=name, step=step, rank=fault_rank)
            die()
        if fault == "savekill" and step == save_every * 2 and rank() == fault_rank:
            arm_kill_in_save(done, step, fault_rank, name)
        if fault == "stall" and step + 1 == fault_step and rank() == 1:
            STALL.update(on=True, seconds=600.0)
            mark(done, step=step + 1, rank=1)
            say(event="stall", scenario=name, step=step + 1, rank=1)

    if fault == "stall":
        model_fn = stall_model
    recipe.main(argv, model_fn=model_fn, on_step=on_step, on_start=on_start)
    if rank() == 0:
        say(event="finished", scenario=name)


def arm_kill_in_save(done: str, step: int, who: int, name: str) -> None:
    """SIGKILL this process once the background save it is writing has written its first piece."""
    from nnscaler_plugins.checkpoint import format as fmt

    original = fmt.PieceWriter.add

    def add(self: Any, t: torch.Tensor) -> int:
        offset = original(self, t)
        self._f.flush()
        mark(done, step=step, rank=who)
        say(event="kill during save", scenario=name, step=step, rank=who, file=self.path)
        die()
        return offset

    fmt.PieceWriter.add = add


def reference(work: str, plan: str, rest: list[str], steps: int, save_every: int) -> None:
    out = os.path.join(work, f"{plan}-ref.pt")
    if not os.path.exists(out):
        recipe.main(["--root", os.path.join(work, f"{plan}-ref"), "--plan", plan, "--out", out, "--steps", str(steps),
                     "--save-every", str(save_every)] + rest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--scenarios", required=True, help="PLAN:FAULT,... (FAULT: kill, savekill, stall, or none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--work-tag", default="", help="appended to each scenario's folder name")
    ap.add_argument("--final-tag", default="", help="appended to each scenario's final weights file name")
    ap.add_argument("--late-rank-on-restart", type=float, default=0.0,
                    help="seconds a restarted attempt's rank 1 waits before joining, so that rank 0 reads the store "
                         "first (where the killed attempt's keys may still be)")
    args, rest = ap.parse_known_args()
    os.makedirs(args.work, exist_ok=True)
    if args.late_rank_on_restart and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 \
            and os.environ.get("RANK") == "1":
        time.sleep(args.late_rank_on_restart)
    for item in args.scenarios.split(","):
        plan, fault = item.split(":")
        if not args.no_reference:
            reference(args.work, plan, rest, args.steps, args.save_every)
        run_scenario(args.work, plan, fault, rest, args.seed, args.steps, args.save_every, args.work_tag,
                     args.final_tag)


if __name__ == "__main__":
    import fault_job  # the classes live in a module with a name, so the generated code can import them

    fault_job.main()
