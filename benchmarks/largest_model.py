"""The largest GPT-2-shaped model each of this library (ZeRO-3 plan, meta-device model), PyTorch
FSDP2 (meta init + `fully_shard` per block) and DeepSpeed ZeRO-3 (`zero.Init`) sets up and trains
two AdamW steps on 4 gloo processes within a per-rank memory budget; and the peak memory per rank
of each at a fixed size (12 layers x 1024).

    python benchmarks/largest_model.py [--budget-mib 1024] [--width 512] [--skip-fixed] [--skip-search]

Memory is each process's peak RSS growth from just after its imports and process group (the
framework's own import is not the model's memory); a size "fits" when every rank's growth stays
within the budget. The budget stands for the memory one process may use: this machine's 24 GiB
are shared, so sizes are found by measuring, never by running into the out-of-memory killer.
The largest size is found per framework by bisection on the layer count at the given width
(secant on the measured peaks to place the first probes, then halving).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

WORLD = 4
VOCAB = 50257
SEQ = 64
LR = 1e-4
FRAMEWORKS = ("ours", "fsdp2", "deepspeed", "ours-offload")


def _config(layers: int, width: int):
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=VOCAB, n_positions=1024,
                      use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _ours(layers: int, width: int, rank: int, offload: Optional[str] = None) -> tuple[list[float], float]:
    """Two steps; the losses and the MiB of training state kept in host memory (offload only:
    the optimizer's tensors, their gradients and state, measured after the second step)."""
    import torch
    from transformers import GPT2LMHeadModel

    import nnscaler_plugins as nns

    batch = _batch(rank)
    with torch.device("meta"):
        model = GPT2LMHeadModel(_config(layers, width))
    pm = nns.parallelize(model, batch, plan="dp", zero=3, cache_dir="/tmp/nns_bench_cache", init_seed=0,
                         offload=offload)
    del model
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=LR)
    losses, host = [], 0.0
    for _ in range(2):
        losses.append(float(pm.train_step(batch)))
        opt.step()
        if offload is not None:
            host = _host_mib(opt)
        opt.zero_grad()
    return losses, host


def _host_mib(opt) -> float:
    """What the offloading optimizer steps and keeps in host memory: its tensors (the masters, under
    offload='params' the parameter chunks themselves), their gradients and the AdamW state."""
    seen, total = set(), 0
    tensors = [p for g in opt.param_groups for p in g["params"]]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [t for st in opt.state.values() for t in st.values() if hasattr(t, "untyped_storage")]
    for t in tensors:
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total / 2**20


def _fsdp2(layers: int, width: int, rank: int) -> list[float]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2LMHeadModel

    batch = _batch(rank)
    with torch.device("meta"):
        model = GPT2LMHeadModel(_config(layers, width))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():  # GPT-2's init on the local shards (values do not matter here, only memory)
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif "ln" in n and n.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(2):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _deepspeed(layers: int, width: int, rank: int) -> list[float]:
    import deepspeed
    from transformers import GPT2LMHeadModel

    batch = _batch(rank)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT2LMHeadModel(_config(layers, width))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)
    losses = []
    for _ in range(2):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def worker(framework: str, layers: int, width: int, out: str) -> None:
    """One rank of one probe (run by `probe` in a subprocess per rank)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if framework == "deepspeed":
        os.environ.update({"LOCAL_RANK": str(rank), "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"})
        import deepspeed  # noqa: F401  (its import is not the model's memory)
    import transformers  # noqa: F401
    if framework.startswith("ours"):
        import nnscaler_plugins  # noqa: F401
        import nnscaler_plugins.runtime.parallel_module  # noqa: F401
    dist.init_process_group("gloo")
    dist.barrier()
    base = max(_rss_peak_mib(), _rss_now_mib())
    t = time.perf_counter()
    host = 0.0
    if framework == "ours-offload":
        losses, host = _ours(layers, width, rank, offload="params")
    elif framework == "ours":
        losses, _ = _ours(layers, width, rank)
    else:
        losses = {"fsdp2": _fsdp2, "deepspeed": _deepspeed}[framework](layers, width, rank)
    grown = _rss_peak_mib() - base
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"grown_mib": grown, "host_mib": host, "base_mib": base, "losses": losses,
                   "s": time.perf_counter() - t}, f)
    dist.destroy_process_group()


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def probe(framework: str, layers: int, width: int, cap_mib: float, timeout: float = 1800) -> dict:
    """Run one size on WORLD processes; the per-rank peaks, or {"failed": reason}. A probe whose
    rank grows past `cap_mib` (over its RSS when its training started, taken as the imports'
    ~400 MiB at most) is stopped there: it does not fit, and the shared machine never meets the
    out-of-memory killer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/largest_model_{os.getpid()}_{framework}_{layers}_{width}"
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", framework, str(layers), str(width), out],
                                      env=env, stdout=subprocess.DEVNULL, stderr=open(f"{out}.err{r}", "w")))
    deadline = time.monotonic() + timeout
    over = None
    while any(p.poll() is None for p in procs):
        rss = [_rss_mib(p.pid) for p in procs]
        if max(rss) > cap_mib + 400 and over is None:
            over = f"a rank passed {cap_mib:.0f} MiB (RSS {max(rss):.0f} MiB): stopped"
        if over is not None or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    errs = []
    for r, p in enumerate(procs):
        with open(f"{out}.err{r}") as f:
            err = f.read()
        os.remove(f"{out}.err{r}")
        if p.returncode != 0:
            errs.append((err.strip().splitlines() or [f"exit {p.returncode}"])[-1])
    if over is not None or errs:
        for r in range(WORLD):
            if os.path.exists(f"{out}.{r}"):
                os.remove(f"{out}.{r}")
        return {"failed": over or errs[0]}
    ranks = []
    for r in range(WORLD):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.{r}")
    return {"grown_mib": [x["grown_mib"] for x in ranks], "host_mib": [x["host_mib"] for x in ranks],
            "device_mib": [x["grown_mib"] - x["host_mib"] for x in ranks], "base_mib": [x["base_mib"] for x in ranks],
            "losses": ranks[0]["losses"], "s": max(x["s"] for x in ranks)}


def _peak(framework: str, r: dict) -> float:
    """The memory a probe is judged by: the peak RSS growth of its worst rank; with offload, that
    less what the rank keeps in host memory (on a GPU machine, what the device would hold)."""
    return max(r["device_mib"] if framework.endswith("offload") else r["grown_mib"])


def largest(framework: str, width: int, budget: float, log: list) -> tuple[int, dict]:
    """The most layers whose probe fits in `budget` MiB per rank (bisection; the first probes
    placed by a line through two measured sizes)."""
    def fits(layers: int) -> tuple[bool, dict]:
        # with offload the host's share grows on top of the budget: the safety cap leaves room for it
        r = probe(framework, layers, width, cap_mib=budget * (3.0 if framework.endswith("offload") else 1.05))
        ok = "failed" not in r and _peak(framework, r) <= budget
        log.append((framework, layers, r))
        print(framework, layers, "fits" if ok else "does not fit", r, flush=True)
        return ok, r

    a_layers, b_layers = 2, 8
    ok_a, ra = fits(a_layers)
    if not ok_a:
        return 0, ra
    ok_b, rb = fits(b_layers)
    lo, hi, best = a_layers, None, (a_layers, ra)
    if ok_b:
        lo, best = b_layers, (b_layers, rb)
        if "failed" not in rb:  # the line through the two peaks places the next probe
            slope = (_peak(framework, rb) - _peak(framework, ra)) / (b_layers - a_layers)
            guess = int(b_layers + (budget - _peak(framework, rb)) / max(slope, 1e-6))
            ok, r = fits(guess)
            if ok:
                lo, best = guess, (guess, r)
                ok2, r2 = fits(guess + 1)
                if ok2:  # the line was pessimistic: gallop
                    lo, best, step = guess + 1, (guess + 1, r2), 2
                    while True:
                        ok3, r3 = fits(lo + step)
                        if not ok3:
                            hi = lo + step
                            break
                        lo, best, step = lo + step, (lo + step, r3), step * 2
                else:
                    hi = guess + 1
            else:
                hi = guess
    else:
        hi = b_layers
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        ok, r = fits(mid)
        if ok:
            lo, best = mid, (mid, r)
        else:
            hi = mid
    return best


def _earlier_rows(title: str, frameworks: list[str]) -> list[tuple[str, ...]]:
    """The rows of RESULTS.md's section `title` for frameworks this run does not measure, marked
    with the date of their run: `common.record` rewrites the whole section, and a rerun of some
    frameworks must not erase the others' numbers."""
    lines = common.recorded_section(title)
    date = lines[2].split(",")[0] if len(lines) > 2 else "?"
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        name = cells[0].split(" (")[0] if cells else ""
        if name in FRAMEWORKS and name not in frameworks:
            rows.append(tuple([cells[0] if "(earlier run" in cells[0] else f"{name} (earlier run, {date})"] + cells[1:]))
    return rows


def _params(layers: int, width: int) -> float:
    return (VOCAB * width + 1024 * width + layers * (12 * width * width + 13 * width) + 2 * width) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="per-rank memory budget of the search")
    ap.add_argument("--width", type=int, default=512, help="width of the search (layers are bisected)")
    ap.add_argument("--fixed-cap-mib", type=float, default=3000.0, help="safety cap of the 12 x 1024 runs")
    ap.add_argument("--skip-fixed", action="store_true")
    ap.add_argument("--skip-search", action="store_true")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = ap.parse_args()
    frameworks = args.frameworks.split(",")
    tail = (f"GPT-2 shape (vocab {VOCAB}, heads of 64, tied head), batch 1 x {SEQ} per rank, AdamW fp32, ZeRO-3 "
            f"over {WORLD} gloo processes (ours: plan dp zero=3 on a meta-device model; FSDP2: fully_shard per block "
            "and the root after meta init, to_empty; DeepSpeed 0.19: zero.Init). Memory: growth of each rank's "
            "peak RSS from after imports and process-group start through set-up and two training steps; a run "
            "past its cap is stopped by the parent (it does not fit).")
    if not args.skip_fixed:
        fixed = {}
        for fw in frameworks:
            fixed[fw] = probe(fw, 12, 1024, cap_mib=args.fixed_cap_mib)
            print("12 x 1024", fw, fixed[fw], flush=True)
        fsdp = fixed.get("fsdp2", {})
        rows = []
        for fw in frameworks:
            r = fixed[fw]
            if "failed" in r:
                rows.append((fw, "does not fit: " + r["failed"][:90], "", ""))
                continue
            ratio = (max(r["grown_mib"]) / max(fsdp["grown_mib"])) if "grown_mib" in fsdp else float("nan")
            rows.append((fw, " / ".join(f"{m:.0f}" for m in r["grown_mib"]), f"{ratio:.2f}",
                         " / ".join(f"{x:.3f}" for x in r["losses"])))
        title = (f"largest_model.py: peak memory per rank at 12 x 1024 ({_params(12, 1024):.0f} M parameters), "
                 "ZeRO-3 on 4 gloo processes")
        rows += _earlier_rows(title, frameworks)
        print(common.record(title, rows,
                            ("framework", "peak RSS growth MiB, ranks 0/1/2/3", "max vs FSDP2", "losses"),
                            notes=tail + f" Cap {args.fixed_cap_mib:.0f} MiB per rank."))
    if args.skip_search:
        return
    log: list = []
    found = {fw: largest(fw, args.width, args.budget_mib, log) for fw in frameworks}
    title = (f"largest_model.py: largest GPT-2 shape trained within {args.budget_mib:.0f} MiB per rank, "
             "ZeRO-3 on 4 gloo processes")
    earlier = _earlier_rows(title, frameworks)
    fsdp_layers = found["fsdp2"][0] if "fsdp2" in found else next(
        (int(r[1].split(" x ")[0]) for r in earlier if r[0].startswith("fsdp2")), None)
    rows = []
    for fw, (layers, r) in found.items():
        peak = _peak(fw, r) if "grown_mib" in r else float("nan")
        shown = f"{peak:.0f}"
        if fw.endswith("offload") and "grown_mib" in r:
            shown += f" (+ {max(r['host_mib']):.0f} host = RSS {max(r['grown_mib']):.0f})"
        rows.append((fw, f"{layers} x {args.width} ({_params(layers, args.width):.0f} M)", shown,
                     f"{layers / max(fsdp_layers, 1):.2f}" if fsdp_layers else ""))
    notes = "Probes (framework layers: max MiB over ranks): " + ", ".join(
        f"{fw} {n}: {_peak(fw, r):.0f}" if "grown_mib" in r else f"{fw} {n}: over"
        for fw, n, r in log) + ". " + tail + (
        " ours-offload: plan dp zero=3 offload='params' (parameter chunks, their gradients and AdamW "
        "state in host memory); it is judged by its peak RSS growth less those host bytes, what a GPU "
        "would hold. On this CPU machine device and host are one memory, so offload cannot lower the "
        "RSS itself; the host bytes are read from the optimizer after the second step."
        if "ours-offload" in frameworks else "")
    rows += earlier
    print(common.record(title, rows,
                        ("framework", "largest (layers x width)", "its peak MiB", "layers vs FSDP2"), notes=notes))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
