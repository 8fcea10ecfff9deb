"""Search plans for a small GPT-2, then train it on N CPU processes (gloo) under several plans and
check the losses.

    python recipes/train_gpt2.py                      # search, then tp, hybrid and auto on 4 processes
    python recipes/train_gpt2.py --nproc 2 --strategies dp,tp --steps 5 --no-search

The search prices plans for this machine (the `local-cpu` cluster, N processes) and writes its
Pareto curve, the fastest plan's device map and, for pipeline plans, its timeline into --out.
Every plan must reproduce, step by step, the loss of one process training on the same global
batch; the script exits non-zero if any differs by more than the tolerance. Under torchrun it runs
only the distributed part for the first strategy (RANK/WORLD_SIZE come from the launcher).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

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


def worker(rank: int, world: int, port: int, strategy: str, steps: int, batch: int, seq: int, lr: float, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        q.put((rank, "losses", train(strategy, steps, batch, seq, lr, rank, world)))
    except BaseException as e:  # report instead of hanging the parent
        import traceback
        q.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def train(strategy: str, steps: int, batch: int, seq: int, lr: float, rank: int, world: int) -> list[float]:
    model = build_model()
    opts = degrees(strategy, world)
    dp = opts.get("dp", world if strategy == "dp" else 1)
    local = batch // dp
    example = {"input_ids": torch.zeros(local, seq, dtype=torch.long), "labels": torch.zeros(local, seq, dtype=torch.long)}
    pm = nns.parallelize(model, example, plan=strategy, **opts)
    if rank == 0:
        print(pm.plan.explain(), flush=True)
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


def search(nproc: int, batch: int, seq: int, out: str) -> None:
    """The search alone: no processes, just the cost model and the simulator on this machine's numbers."""
    from nnscaler_plugins.render import render_device_map, render_pareto

    model = build_model()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    graph = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    spec = nns.cluster("local-cpu", devices=nproc)
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
    ap.add_argument("--out", default="nnscaler_out", help="where the search writes its renderings")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-4)
    a = ap.parse_args()
    strategies = [s for s in a.strategies.split(",") if s]

    if "RANK" in os.environ:  # launched by torchrun: run one strategy, print from rank 0
        losses = train(strategies[0], a.steps, a.batch, a.seq, a.lr, int(os.environ["RANK"]),
                       int(os.environ["WORLD_SIZE"]))
        if int(os.environ["RANK"]) == 0:
            print("losses:", losses)
        return 0

    if not a.no_search:
        search(a.nproc, a.batch, a.seq, a.out)
    t0 = time.time()
    ref = reference_losses(a.steps, a.batch, a.seq, a.lr)
    print(f"single process, global batch {a.batch}: losses {[round(x, 6) for x in ref]} ({time.time() - t0:.1f}s)")
    ok = True
    ctx = mp.get_context("spawn")
    for strategy in strategies:
        t0 = time.time()
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, a.nproc, port, strategy, a.steps, a.batch, a.seq, a.lr, q))
                 for r in range(a.nproc)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, kind, payload = q.get(timeout=600)
            if kind == "error":
                print(f"[{strategy}] rank {rank} failed:\n{payload}", file=sys.stderr)
                ok = False
            results[rank] = payload
        for p in procs:
            p.join()
        if kind == "error" or 0 not in results or isinstance(results[0], str):
            ok = False
            continue
        got = results[0]
        worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
        same = worst <= a.rtol
        ok &= same
        print(f"[{strategy}] {a.nproc} processes: losses {[round(x, 6) for x in got]}  "
              f"max rel diff vs single process {worst:.2e} -> {'EQUAL' if same else 'DIFFERENT'} "
              f"({time.time() - t0:.1f}s)", flush=True)
    print("all plans match the single-process run" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
