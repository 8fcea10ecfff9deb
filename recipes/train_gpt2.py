"""Search plans for a tiny GPT-2, then train it on N CPU processes (gloo) under several plans and
check the losses.

    python recipes/train_gpt2.py                      # search, then tp, hybrid and auto on 4 processes
    python recipes/train_gpt2.py --nproc 2 --strategies dp,tp --steps 5 --no-search

The model is GPT-2's architecture at a tiny size (2 layers, width 128, vocabulary 512), so that
every plan trains in seconds on a laptop's CPU; the header line names its shape and size. The
search prices plans for this machine (the `local-cpu` cluster, N processes, measured once and
cached; `--no-measure` uses fixed typical CPU numbers instead) and writes its Pareto curve, the
fastest plan's device map and, for pipeline plans, its timeline into --out. Each strategy's plan is
made and validated here, before any process starts, then run by every process; rank 0 reports each
step's loss as it comes. Every plan must reproduce, step by step, the loss of one process training
on the same global batch. The job ends with a table (plan, step time, loss difference, verdict);
a plan that cannot be made or run is named with its reason on the last line (the tracebacks go to
--out) and the exit code is 1. Under torchrun it runs only the distributed part for the first
strategy (RANK/WORLD_SIZE come from the launcher).
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nnscaler_plugins as nns
from nnscaler_plugins.progress import Progress
from nnscaler_plugins.render import plan_label


def build_model(seed: int = 0):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # the small config's defaults are fine; keep the output readable

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def describe_model(model=None) -> str:
    """The model named for what it is: GPT-2's architecture at this size, with its parameter count."""
    model = model if model is not None else build_model()
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return (f"tiny GPT-2 ({c.n_layer} layers, width {c.n_embd}, {c.n_head} heads, vocabulary {c.vocab_size}; "
            f"{n / 1e6:.2f} M parameters)")


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


def reference_losses(steps: int, batch: int, seq: int, lr: float, on_step=None) -> list[float]:
    """One process on the whole global batch; `on_step(step, loss, seconds)` after each step."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i, ids in enumerate(make_batches(steps, batch, seq)):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i, losses[-1], time.perf_counter() - t0)
    return losses


def worker(rank: int, world: int, port: int, plan, steps: int, batch: int, seq: int, lr: float, q):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        report = (lambda kind, payload: q.put((rank, kind, payload))) if rank == 0 else None
        q.put((rank, "losses", train(plan, steps, batch, seq, lr, rank, world, report)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, once, instead of a traceback per rank
        import traceback
        q.put((rank, "error", (reason(e), traceback.format_exc())))
        return
    dist.destroy_process_group()


def reason(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def train(plan, steps: int, batch: int, seq: int, lr: float, rank: int, world: int, report=None) -> list[float]:
    """Train under `plan` on this rank; `report(kind, payload)` hears "ready" (the collectives per
    forward) once the module is built and "step" (step, loss, seconds) after each step."""
    model = build_model()
    local = batch // plan.dp
    example = {"input_ids": torch.zeros(local, seq, dtype=torch.long),
               "labels": torch.zeros(local, seq, dtype=torch.long)}
    pm = nns.parallelize(model, example, plan=plan)
    if report is not None:
        report("ready", dict(pm.program.collective_counts(0)))
    elif rank == 0:
        print(f"  collectives per forward on device 0: {dict(pm.program.collective_counts(0)) or 'none'}", flush=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for i, ids in enumerate(make_batches(steps, batch, seq)):
        t0 = time.perf_counter()
        mine = ids[pm.dp_rank * local:(pm.dp_rank + 1) * local]
        loss = pm.train_step({"input_ids": mine, "labels": mine})
        opt.step()
        opt.zero_grad()
        if pm.dp_size > 1:  # the global loss is the mean over replicas; every rank holds its replica's
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        if report is not None:
            report("step", (i, losses[-1], time.perf_counter() - t0))
    return losses


def run_plan(plan, nproc: int, steps: int, batch: int, seq: int, lr: float, timeout: float = 600.0,
             grace: float = 15.0, on_event=None) -> tuple[Optional[list[float]], Optional[str], str]:
    """Train `plan` on `nproc` processes: (rank 0's losses, None, "") or (None, the first failure as
    one line, every failing rank's traceback). Once a rank has failed the others get `grace` seconds
    to finish (they may be waiting in a collective for it), then they are stopped. Rank 0's "ready"
    and "step" reports go to `on_event(kind, payload)` as they arrive, so a person sees the run;
    a second without news is `on_event("waiting", None)`."""
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
            if on_event is not None:
                on_event("waiting", None)
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
        elif kind == "losses":
            results[rank] = payload
        elif on_event is not None:
            on_event(kind, payload)
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
    from nnscaler_plugins.render import render_device_map, render_pareto, render_timeline

    model = build_model()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    graph = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    t0 = time.time()
    plans = nns.search(graph, world_size=nproc, cluster=spec)
    print(f"[search] {len(plans)} plan(s) on the Pareto frontier of step time and memory for {nproc} processes, "
          f"{plans.searched} candidates priced, {time.time() - t0:.1f} s:")
    print(plans.table(), flush=True)
    os.makedirs(out, exist_ok=True)
    render_pareto(plans, os.path.join(out, "pareto.svg"), title=f"{describe_model(model)} on {nproc} CPU processes",
                  memory_limit=spec.memory_bytes)
    render_device_map(plans.best, os.path.join(out, "best_devices.svg"), graph, title="fastest plan (#0)")
    if plans.best.pipeline is not None:
        est = nns.simulate(plans.best, spec, keep_timeline=True)
        render_timeline(est.timeline, os.path.join(out, "best_timeline.svg"), title="fastest plan (#0)", estimate=est)
    plans.best.save(os.path.join(out, "best_plan.json"))
    print(f"[search] the curve (pareto.svg), the fastest plan's device map and the plan itself are in {out}/",
          flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_machine(nproc: int, measure: bool):
    """This machine as `nproc` processes, saying where its numbers come from and how long that took."""
    if not measure:
        spec = local_cpu(nproc, False)
        print("[machine] fixed typical CPU numbers (--no-measure), nothing measured", flush=True)
        return spec
    t0 = time.perf_counter()
    spec = local_cpu(nproc, True)  # measures on the first run (a progress line), else reads the cache
    took = time.perf_counter() - t0
    where = "measured now" if took > 1.0 else "from the cache of an earlier measurement"
    print(f"[machine] {spec.notes} ({where}, {took:.1f} s): {spec.describe()}", flush=True)
    return spec


def closing_table(rows: list[tuple[str, str, str, str]]) -> str:
    """Plan, step time, loss difference vs one process, verdict: one aligned line each."""
    head = ("plan", "step time", "max loss diff vs 1 process", "verdict")
    widths = [max(len(r[k]) for r in rows + [head]) for k in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def typical_step(times: list[float]) -> float:
    """The median step time, leaving out the first step (warm-up) when there are others."""
    rest = times[1:] or times
    return statistics.median(rest) if rest else float("nan")


def step_line(name: str, steps: int, step: int, loss: float, seconds: float, ref: Optional[list[float]] = None) -> str:
    diff = ""
    if ref is not None and step < len(ref):
        diff = f"  (one process {ref[step]:.6f}, rel diff {abs(loss - ref[step]) / abs(ref[step]):.1e})"
    return f"[{name}] step {step + 1}/{steps} loss {loss:.6f}  {seconds * 1e3:.0f} ms{diff}"


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

    start = time.perf_counter()
    print(f"[main job] {describe_model()}: search plans for {a.nproc} CPU processes, then train {a.steps} steps "
          f"(global batch {a.batch} x {a.seq} tokens) under {', '.join(strategies)} and compare every loss with "
          "one process", flush=True)
    spec = measure_machine(a.nproc, not a.no_measure)
    failures: list[tuple[str, str]] = []
    if not a.no_search:
        try:
            search(a.nproc, a.batch, a.seq, a.out, spec)
        except Exception as e:  # noqa: BLE001 - one line, then the training checks still run
            print(f"[search] FAILED: {reason(e)}", flush=True)
            failures.append(("search", reason(e)))
    ref_times: list[float] = []

    def ref_step(i: int, loss: float, dt: float) -> None:
        ref_times.append(dt)
        print(step_line("one process", a.steps, i, loss, dt), flush=True)

    ref = reference_losses(a.steps, a.batch, a.seq, a.lr, ref_step)
    rows = [("one process (reference)", f"{typical_step(ref_times) * 1e3:.0f} ms", "-", "reference")]
    for strategy in strategies:
        t0 = time.perf_counter()
        try:
            plan = make_plan(strategy, a.nproc, a.batch, a.seq, spec)
        except Exception as e:  # noqa: BLE001 - a plan that cannot be made is reported, not raised
            print(f"[{strategy}] FAILED before launch: {reason(e)}", flush=True)
            failures.append((strategy, reason(e)))
            rows.append((strategy, "-", "-", "FAILED"))
            continue
        label = f"{strategy}: {plan_label(plan)}"
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{strategy}-plan.txt"), "w") as f:
            f.write(plan.explain() + "\n")
        print(f"[{strategy}] plan {plan_label(plan)} (how each op is split: {a.out}/{strategy}-plan.txt); starting "
              f"{a.nproc} processes (import, capture, code generation) ...", flush=True)
        times: list[float] = []
        waiting = Progress(f"[{strategy}] starting", stream=sys.stdout, delay_s=10.0, every_s=10.0, inplace=False)

        def on_event(kind, payload, strategy=strategy, t0=t0, times=times, waiting=waiting):
            if kind == "waiting":
                if not times:
                    waiting.draw()
            elif kind == "ready":
                counts = ", ".join(f"{n} {k}" for k, n in sorted(payload.items())) or "none"
                print(f"[{strategy}] ready after {time.perf_counter() - t0:.1f} s; collectives per forward on "
                      f"device 0: {counts}", flush=True)
            elif kind == "step":
                i, loss, dt = payload
                times.append(dt)
                print(step_line(strategy, a.steps, i, loss, dt, ref), flush=True)

        got, error, log = run_plan(plan, a.nproc, a.steps, a.batch, a.seq, a.lr, on_event=on_event)
        if error is not None:
            where = ""
            if log:
                path = os.path.join(a.out, f"{strategy}-errors.log")
                with open(path, "w") as f:
                    f.write(log)
                where = f" (tracebacks in {path})"
            print(f"[{strategy}] FAILED on {a.nproc} processes: {error}{where}", flush=True)
            failures.append((strategy, error))
            rows.append((label, "-", "-", "FAILED"))
            continue
        worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
        same = worst <= a.rtol
        if not same:
            failures.append((strategy, f"losses differ from one process by up to {worst:.1e} relative "
                                       f"(tolerance {a.rtol:.0e})"))
        step = typical_step(times)
        rows.append((label, f"{step * 1e3:.0f} ms", f"{worst:.1e} relative", "EQUAL" if same else "DIFFERENT"))
        print(f"[{strategy}] {'EQUAL' if same else 'DIFFERENT'}: max relative loss difference {worst:.1e} "
              f"(tolerance {a.rtol:.0e}), {time.perf_counter() - t0:.1f} s in all", flush=True)
    print(closing_table(rows), flush=True)
    total = time.perf_counter() - start
    if failures:
        print("FAILED: " + "; ".join(f"plan {name!r}: {why}" for name, why in failures)
              + f" ({total:.0f} s)", flush=True)
        return 1
    print(f"OK: every plan matches the single-process run ({len(strategies)} plans, {total:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
