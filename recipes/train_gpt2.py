"""Search plans for a small GPT-2, then train it on N CPU processes (gloo) under several plans and
check the losses.

    python recipes/train_gpt2.py                      # search, then tp, hybrid and auto on 4 processes
    python recipes/train_gpt2.py --nproc 2 --strategies dp,tp --steps 5 --no-search

The search prices plans for this machine (the `local-cpu` cluster, N processes; `--no-measure`
uses fixed typical CPU numbers instead of measuring it) and writes its Pareto curve, the fastest
plan's device map and, for pipeline plans, its timeline into --out. Each strategy's plan is made
and validated here, before any process starts, then run by every process. Every plan must
reproduce, step by step, the loss of one process training on the same global batch. A plan that
cannot be made or run is reported on one line (its name and the reason; the tracebacks go to
--out); the script exits non-zero if any plan failed or differs by more than the tolerance. Under
torchrun it runs only the distributed part for the first strategy (RANK/WORLD_SIZE come from the
launcher).
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nnscaler_plugins as nns


def build_model(seed: int = 0):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # the small config's defaults are fine; keep the output readable

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def make_batches(steps: int, batch: int, seq: int, vocab: int = 512):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def degrees(strategy: str, world: int) -> dict:
    if strategy == "hybrid":
        return {"tp": 2, "dp": world // 2}
    return {}


def local_cpu(nproc: int, measure: bool):
    """This machine as `nproc` processes: measured once and cached, or fixed typical numbers."""
    return nns.cluster("local-cpu", devices=nproc, measure=measure)


def make_plan(strategy: str, world: int, batch: int, seq: int, cluster=None):
    """The strategy's plan for `world` processes, made and validated before any process runs it
    (strategy "auto" searches `cluster` here, once). Each replica's batch is its share of `batch`."""
    from nnscaler_plugins.plugins import get_strategy

    opts = degrees(strategy, world)
    try:
        fn = get_strategy(strategy)
    except KeyError as e:
        raise nns.PlanError(str(e.args[0])) from None
    deg = getattr(fn, "degrees", None)
    dp = deg(world, **opts)[1] if deg is not None else opts.get("dp", 1)
    if batch % dp:
        raise nns.PlanError(f"the global batch of {batch} does not divide among {dp} data-parallel replicas")
    if strategy == "auto" and cluster is not None:
        opts["cluster"] = cluster
    example = {"input_ids": torch.zeros(batch // dp, seq, dtype=torch.long),
               "labels": torch.zeros(batch // dp, seq, dtype=torch.long)}
    return nns.plan(build_model(), strategy=strategy, world_size=world, example_inputs=example, **opts)


def reference_losses(steps: int, batch: int, seq: int, lr: float) -> list[float]:
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in make_batches(steps, batch, seq):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, port: int, plan, steps: int, batch: int, seq: int, lr: float, q):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        q.put((rank, "losses", train(plan, steps, batch, seq, lr, rank, world)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, once, instead of a traceback per rank
        import traceback
        q.put((rank, "error", (reason(e), traceback.format_exc())))
        return
    dist.destroy_process_group()


def reason(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def train(plan, steps: int, batch: int, seq: int, lr: float, rank: int, world: int) -> list[float]:
    model = build_model()
    local = batch // plan.dp
    example = {"input_ids": torch.zeros(local, seq, dtype=torch.long), "labels": torch.zeros(local, seq, dtype=torch.long)}
    pm = nns.parallelize(model, example, plan=plan)
    if rank == 0:
        counts = pm.program.collective_counts(0)
        print(f"  collectives per forward on device 0: {dict(counts) or 'none'}", flush=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for ids in make_batches(steps, batch, seq):
        mine = ids[pm.dp_rank * local:(pm.dp_rank + 1) * local]
        loss = pm.train_step({"input_ids": mine, "labels": mine})
        opt.step()
        opt.zero_grad()
        if pm.dp_size > 1:  # the global loss is the mean over replicas; every rank holds its replica's
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def run_plan(plan, nproc: int, steps: int, batch: int, seq: int, lr: float,
             timeout: float = 600.0, grace: float = 15.0) -> tuple[Optional[list[float]], Optional[str], str]:
    """Train `plan` on `nproc` processes: (rank 0's losses, None, "") or (None, the first failure as
    one line, every failing rank's traceback). Once a rank has failed the others get `grace` seconds
    to finish (they may be waiting in a collective for it), then they are stopped."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, nproc, port, plan, steps, batch, seq, lr, q)) for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, list[float]] = {}
    errors: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < nproc:
        now = time.monotonic()
        if now > deadline:
            errors.setdefault(-1, (f"no result from rank(s) {sorted(set(range(nproc)) - set(results) - set(errors))} "
                                   f"within {timeout:.0f} s", ""))
            break
        try:
            rank, kind, payload = q.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
            if dead and q.empty():
                time.sleep(1.0)  # a result may still be in flight
                if q.empty():
                    errors.setdefault(dead[0], (f"process of rank {dead[0]} died (exit code "
                                                f"{procs[dead[0]].exitcode})", ""))
            continue
        if kind == "error":
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + grace)
        else:
            results[rank] = payload
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        first = min(errors)
        log = "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(errors.items()) if tb)
        return None, errors[first][0], log
    return results.get(0), None, ""


def search(nproc: int, batch: int, seq: int, out: str, spec) -> None:
    """The search alone: no processes, just the cost model and the simulator on this machine's numbers."""
    from nnscaler_plugins.render import render_device_map, render_pareto

    model = build_model()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    graph = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    t0 = time.time()
    plans = nns.search(graph, world_size=nproc, cluster=spec)
    print(f"search on {spec.describe()}: {len(plans)} plan(s) on the "
          f"frontier, {plans.searched} priced, {time.time() - t0:.1f}s")
    print(plans.table(), flush=True)
    os.makedirs(out, exist_ok=True)
    render_pareto(plans, os.path.join(out, "pareto.svg"), title=f"GPT-2 small on {nproc} CPU processes")
    render_device_map(plans.best, os.path.join(out, "best_devices.svg"), graph, title="fastest plan")
    if plans.best.pipeline is not None:
        plans.best.render_timeline(os.path.join(out, "best_timeline.svg"))
    plans.best.save(os.path.join(out, "best_plan.json"))
    print(f"renderings and the fastest plan written to {out}/", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--strategies", default="tp,hybrid,auto")
    ap.add_argument("--no-search", action="store_true", help="skip the plan search before training")
    ap.add_argument("--no-measure", action="store_true",
                    help="price plans with fixed typical CPU numbers instead of measuring this machine")
    ap.add_argument("--out", default="nnscaler_out", help="where the search writes its renderings")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()
    strategies = [s for s in a.strategies.split(",") if s]

    if "RANK" in os.environ:  # launched by torchrun: run one strategy, print from rank 0
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        plan = make_plan(strategies[0], world, a.batch, a.seq, local_cpu(world, not a.no_measure))
        losses = train(plan, a.steps, a.batch, a.seq, a.lr, rank, world)
        if rank == 0:
            print("losses:", losses)
        return 0

    spec = local_cpu(a.nproc, not a.no_measure)
    ok, differ = True, False
    if not a.no_search:
        try:
            search(a.nproc, a.batch, a.seq, a.out, spec)
        except Exception as e:  # noqa: BLE001 - one line, then the training checks still run
            print(f"[search] FAILED: {reason(e)}", flush=True)
            ok = False
    t0 = time.time()
    ref = reference_losses(a.steps, a.batch, a.seq, a.lr)
    print(f"single process, global batch {a.batch}: losses {[round(x, 6) for x in ref]} ({time.time() - t0:.1f}s)")
    for strategy in strategies:
        t0 = time.time()
        try:
            plan = make_plan(strategy, a.nproc, a.batch, a.seq, spec)
        except Exception as e:  # noqa: BLE001 - a plan that cannot be made is reported, not raised
            print(f"[{strategy}] FAILED before launch: {reason(e)}", flush=True)
            ok = False
            continue
        print(plan.explain(), flush=True)
        got, error, log = run_plan(plan, a.nproc, a.steps, a.batch, a.seq, a.lr)
        if error is not None:
            where = ""
            if log:
                os.makedirs(a.out, exist_ok=True)
                path = os.path.join(a.out, f"{strategy}-errors.log")
                with open(path, "w") as f:
                    f.write(log)
                where = f" (tracebacks in {path})"
            print(f"[{strategy}] FAILED on {a.nproc} processes: {error}{where}", flush=True)
            ok = False
            continue
        worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
        same = worst <= a.rtol
        ok &= same
        differ |= not same
        print(f"[{strategy}] {a.nproc} processes: losses {[round(x, 6) for x in got]}  "
              f"max rel diff vs single process {worst:.2e} -> {'EQUAL' if same else 'DIFFERENT'} "
              f"({time.time() - t0:.1f}s)", flush=True)
    if ok:
        print("all plans match the single-process run", flush=True)
    elif differ:
        print("MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
