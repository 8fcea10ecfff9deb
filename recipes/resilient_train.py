"""A training loop that survives faults: it starts from the newest complete checkpoint, saves in the
background while it trains, and continues on the same trajectory after a restart on any number of
processes.

    torchrun --nproc-per-node 2 --max-restarts 3 recipes/resilient_train.py --root ckpt --plan tp --steps 40
    torchrun --nproc-per-node 1 recipes/resilient_train.py --root ckpt --plan tp --steps 60   # fewer processes

What makes a restart lose nothing:

- The job loads `nns.checkpoint.latest(root)` when it starts; the step is in the checkpoint's extra
  values, the model and optimizer state load under whatever plan the job has now (each rank reads
  only its pieces), and each rank's random number generators are restored when the plan and world
  size are those of the save (the same dropout masks).
- The data order follows the step, not the process: step s trains on global batch s (made from a
  seed and s here; with a real dataset, a sampler positioned at s * global batch), and each
  data-parallel replica takes its slice of it.
- The global batch stays the same on any world size: each replica's slice is cut into micro-batches
  of `--micro-batch-size`, so fewer replicas accumulate more micro-batches per step.
- Checkpoints are written with `background=True` every `--save-every` steps into `root/step-N`; a
  process killed while one is written leaves the previous ones intact, and `latest` skips the
  unfinished one. The newest `--keep` are kept.
- A hung collective is reported after `--collective-timeout` seconds (which rank is missing, in
  which op and source line, where every rank was) and the process exits with code 75, so torchrun
  restarts the job; a non-finite loss or gradient stops the job before any weight changes
  (`--on-nonfinite skip` skips the step instead).

The model is a small residual MLP (`build_model`); replace it, and `global_batch`, with yours.
`--out FILE` writes the final weights (whole, from rank 0). recipes/slurm_train.sbatch runs this
script on several nodes.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import nnscaler_plugins as nns
from nnscaler_plugins.plan.source import resolve

IN, CLASSES = 16, 8


class Block(torch.nn.Module):
    def __init__(self, d: int, dropout: float = 0.1):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.nn.functional.gelu(self.fc(h)))


class Net(torch.nn.Module):
    """A residual MLP: an input layer, `layers` blocks (pipeline stages cut between them), a head."""

    def __init__(self, width: int = 32, layers: int = 4, dropout: float = 0.1):
        super().__init__()
        self.inp = torch.nn.Linear(IN, width)
        self.blocks = torch.nn.ModuleList([Block(width, dropout) for _ in range(layers)])
        self.head = torch.nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.head(h), labels)


def build_model(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net(dropout=dropout)


def global_batch(step: int, size: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Step `step`'s whole batch: the same samples whatever the number of processes."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return {"x": torch.randn(size, IN, generator=g), "labels": torch.randint(0, CLASSES, (size,), generator=g)}


def replica_slice(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    n = next(iter(batch.values())).shape[0]
    if n % dp_size:
        raise SystemExit(f"the global batch of {n} does not split over {dp_size} data-parallel replicas")
    k = n // dp_size
    return {name: t[dp_rank * k:(dp_rank + 1) * k] for name, t in batch.items()}


def replicas(plan: str, world_size: int, options: dict[str, Any]) -> int:
    """Data-parallel replicas the plan has on this world (before anything is captured)."""
    unit, dp = resolve(plan, "--plan").degrees(world_size, options)
    return dp


def prune(root: str, keep: int) -> None:
    """Rank 0, with no save in flight: delete all but the newest `keep` complete checkpoints
    `step-N` under `root`, and what saves killed on their way left (hidden `.step-N.saving-*`)."""
    done = sorted(p for p in glob.glob(os.path.join(root, "step-*")) if nns.checkpoint.is_complete(p))
    for path in (done[:-keep] if keep > 0 else []) + glob.glob(os.path.join(root, ".step-*.saving-*")):
        shutil.rmtree(path, ignore_errors=True)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="folder of this job's checkpoints")
    ap.add_argument("--plan", default="tp", help="strategy name (planned again for each world size), or 'auto'")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=INT",
                    help="a degree option of the strategy, e.g. --option tp=2 (repeatable)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per micro-batch: fewer replicas accumulate more micro-batches")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--collective-timeout", type=float, default=None, help="seconds (default: the backend's)")
    ap.add_argument("--on-nonfinite", default="raise", choices=("raise", "skip", "ignore"))
    ap.add_argument("--report-dir", default=None, help="where hang reports go (default: ROOT/reports)")
    ap.add_argument("--cache-dir", default="/tmp/nnscaler_cache")
    ap.add_argument("--out", default=None, help="write the final whole weights here (rank 0)")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None, *, model_fn: Callable[..., torch.nn.Module] = build_model,
         on_step: Optional[Callable[[int, Any, Any], None]] = None,
         on_start: Optional[Callable[[int, Any], None]] = None) -> int:
    """Train to `--steps`. `on_step(step, module, optimizer)` runs after each optimizer step and
    `on_start(first_step, module)` once resumed (tests inject faults there)."""
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = {k: int(v) for k, v in (o.split("=", 1) for o in args.option)}
    options: dict[str, Any] = {"on_nonfinite": args.on_nonfinite,
                               "report_dir": args.report_dir or os.path.join(args.root, "reports"), **degrees}
    if args.micro_batch_size:
        options["micro_batch_size"] = args.micro_batch_size
    if args.collective_timeout:
        options["collective_timeout_s"] = args.collective_timeout
    dp = replicas(args.plan, world, degrees)
    rank = int(os.environ.get("RANK", "0"))
    dp_rank = rank // (world // dp)
    example = replica_slice(global_batch(0, args.global_batch), dp_rank, dp)
    pm = nns.parallelize(model_fn(dropout=args.dropout), example, plan=args.plan, cache_dir=args.cache_dir, **options)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=args.lr, momentum=0.9)
    assert pm.dp_rank == dp_rank and pm.dp_size == dp, (pm.dp_rank, pm.dp_size, dp_rank, dp)

    start = 0
    path = nns.checkpoint.latest(args.root)
    if path is not None:
        start = nns.checkpoint.load(path, pm, opt)["step"]
        if rank == 0:
            print(f"resumed from {path} at step {start} on {world} process(es) (plan {pm.plan.mesh.describe()}, "
                  f"{pm.plan.num_micro_batches} micro-batch(es) per step)", flush=True)
    if on_start is not None:
        on_start(start, pm)
    handle = None
    for step in range(start, args.steps):
        loss = pm.train_step(replica_slice(global_batch(step, args.global_batch), pm.dp_rank, pm.dp_size))
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step + 1, pm, opt)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            if handle is not None:
                handle.wait()
                if rank == 0:
                    prune(args.root, args.keep)
            handle = nns.checkpoint.save(os.path.join(args.root, f"step-{step + 1:08d}"), pm, opt,
                                         background=True, step=step + 1)
    if handle is not None:
        handle.wait()
    state = pm.full_state_dict(rank0_only=True)
    if rank == 0 and args.out:
        torch.save(state, args.out)
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
