"""Training-step speed and peak memory per rank against PyTorch's own parallelism, 4 gloo processes.

    python benchmarks/step_speed.py [--iters 20] [--no-compile] [--only eager]

One GPT-2-shaped model (pre-norm blocks, learned positions, tied embedding and LM head; written with
nn.Linear so DTensor's ColwiseParallel / RowwiseParallel take its layers) and one global batch, run
by each pair in the same processes, their steps interleaved (each timed iteration runs every
variant once, the order rotating), AdamW for all:

- `dp` plan vs DistributedDataParallel (each rank a quarter of the batch);
- `zero3` plan vs FSDP2 (`fully_shard` on every block, then the model);
- the same with torch.compile: FSDP2 over blocks compiled one by one (as torchtitan does) vs the
  `zero3` plan with `compile=True` when the plan knob compiles (torch._dynamo sees our step), else
  that row says so and compares with our eager step;
- the eager executor (`executor="eager"`: the model's own forward on module hooks, what runs a model
  capture cannot take) under `dp` vs DDP and under `zero3` vs FSDP2;
- `megatron` tp 4 vs DTensor tensor parallelism (`parallelize_module`: q/k/v and the MLP's first
  linear column-wise, the attention output and the MLP's second row-wise; every rank the whole
  batch).

`nns.build_optimizer` builds torch's AdamW with its fused kernel (runtime/fused_optimizer.py); the
peers run `torch.optim.AdamW` as their users write it, torch's default implementation. `--peers-fused`
gives the peers the fused kernel too where torch runs it (DDP's plain tensors; not FSDP2's or
tensor parallelism's DTensors, which `aten._fused_adamw_` refuses on a CPU), their rows then named
so, to show how much of a ratio that choice is.

The ratio is peer's median step time over ours (> 1: ours is faster); the median of the
per-iteration ratios (peer and ours timed in the same iteration) is shown beside it. Peak memory is
each rank's peak resident memory during three training steps above its value just before the model
is built (MiB, ranks 0-3), in a fresh set of processes per variant, the median of `--memory-runs` (3) such runs; freed heap goes back to the system
after set-up for every variant alike, so set-up's transient peak (capture and compile, for ours) is
shown apart, in brackets. On a GPU the device's peak memory stands for the first figure. The machine
is shared: the load average is written with the rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

WORLD = 4
LAYERS, DIM, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 2048, 128, 16  # global batch of 16 sequences


class Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.o = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = torch.nn.LayerNorm(d), Attention(d, heads)
        self.ln_2, self.mlp = torch.nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Shaped(torch.nn.Module):
    def __init__(self, layers: int = LAYERS, d: int = DIM, heads: int = HEADS, vocab: int = VOCAB, positions: int = SEQ):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(positions, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialization
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))


def model() -> GPT2Shaped:
    torch.manual_seed(0)
    return GPT2Shaped()


# -- the variants: each builds its module and returns (step(), first loss) ------------------------------------
def _dp_batch(rank: int) -> dict:
    full = common.batch(BATCH, SEQ, VOCAB)
    n = BATCH // WORLD
    return {k: v[rank * n:(rank + 1) * n] for k, v in full.items()}


PEERS_FUSED = False  # set in each worker from --peers-fused


def _fused_runs(module: torch.nn.Module) -> bool:
    """Whether torch's fused AdamW takes the module's parameters: not DTensors (FSDP2's, tensor
    parallelism's), whose step counter stays a plain tensor that `aten._fused_adamw_` refuses to mix."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in module.parameters())


def _plain_step(module: torch.nn.Module, batch: dict):
    fused = PEERS_FUSED and _fused_runs(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, **({"fused": True} if fused else {}))

    def step() -> float:
        loss = module(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step


def _ours(plan: str, batch: dict, **options):
    import nnscaler_plugins as nns

    pm = nns.parallelize(model(), batch, plan=plan, cache_dir="/tmp/nns_bench_cache", **options)
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        loss = pm.train_step(batch)
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step


def _fsdp2(rank: int, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    m = model()
    for i, block in enumerate(m.blocks):
        if compiled:
            block.compile()  # per block, as torchtitan: one compiled graph serves every block
        fully_shard(block)
    fully_shard(m)
    return _plain_step(m, _dp_batch(rank))


def _dtensor_tp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in m.blocks:
        parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                         "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    return _plain_step(m, common.batch(BATCH, SEQ, VOCAB))


def build(name: str, rank: int):
    """The variant's step function."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name == "DDP":
        return _plain_step(DDP(model()), _dp_batch(rank))
    if name == "ours dp":
        return _ours("dp", _dp_batch(rank))
    if name == "FSDP2":
        return _fsdp2(rank, False)
    if name == "FSDP2 compiled":
        return _fsdp2(rank, True)
    if name == "ours zero3":
        return _ours("zero3", _dp_batch(rank))
    if name == "ours zero3 compiled":
        return _ours("zero3", _dp_batch(rank), compile=True)
    if name == "ours dp eager":
        return _ours("dp", _dp_batch(rank), executor="eager")
    if name == "ours zero3 eager":
        return _ours("zero3", _dp_batch(rank), executor="eager")
    if name == "DTensor tp":
        return _dtensor_tp()
    if name == "ours tp":
        return _ours("megatron", common.batch(BATCH, SEQ, VOCAB), tp=WORLD)
    raise ValueError(name)


PAIRS = [("DDP", "ours dp"), ("FSDP2", "ours zero3"), ("FSDP2 compiled", "ours zero3 compiled"),
         ("DDP", "ours dp eager"), ("FSDP2", "ours zero3 eager"), ("DTensor tp", "ours tp")]


def compiles(step) -> tuple[bool, float]:
    """Whether torch._dynamo compiles anything in the first step (the plan knob at work), and that
    step's loss."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    loss = step()
    return counters["stats"]["unique_graphs"] > before, loss


# -- timing ------------------------------------------------------------------------------------------------
def pairs(only: str = "") -> list[tuple[str, str]]:
    """The pairs to run: all, or those whose "ours" side's name contains `only`."""
    return [p for p in PAIRS if only in p[1]]


def bench(rank: int, world: int, iters: int, with_compile: bool, peers_fused: bool = False, only: str = "") -> dict:
    import torch.distributed as dist

    global PEERS_FUSED
    PEERS_FUSED = peers_fused

    names = list(dict.fromkeys(n for pair in pairs(only) for n in pair if with_compile or "compiled" not in n))
    steps, losses, notes = {}, {}, {}
    if "ours zero3 compiled" in names:
        step = build("ours zero3 compiled", rank)
        did, first = compiles(step)
        ok = torch.tensor(float(did))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() > 0:
            steps["ours zero3 compiled"], losses["ours zero3 compiled"] = step, first
        else:
            notes["ours zero3 compiled"] = "compile=True does not compile in this build (no frame reached torch._dynamo)"
        names.remove("ours zero3 compiled")
    for name in names:
        steps[name] = build(name, rank)
    for name, step in steps.items():  # warm-up (compilation included), the first loss kept
        loss = step()
        losses.setdefault(name, loss)
        step()
    dist.barrier()
    times: dict[str, list[float]] = {n: [] for n in steps}
    order = list(steps)
    for i in range(iters):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            dist.barrier()
            t = time.perf_counter()
            steps[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - t)
    return {"times": times, "losses": losses, "notes": notes, "load": os.getloadavg()[0]}


# -- memory ------------------------------------------------------------------------------------------------
def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim_and_reset_peak() -> None:
    """Give freed heap back to the system (glibc's malloc_trim), then restart the kernel's peak-RSS
    count (VmHWM) at the current RSS: what follows is measured from here."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load_tracing_code() -> None:
    """Import the code torch's tracing loads on first use (torch.export, dynamo, sympy: tens of MiB of
    Python modules), by exporting a one-layer module, before the baseline for every variant alike.
    Loaded code is host memory that no device holds and that a process pays once whatever its model;
    left in, it counted toward the first variant that traces (ours, which captures with torch.export)
    and toward none of the eager peers."""
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), strict=False)


def bench_memory(rank: int, world: int, name: str, peers_fused: bool = False) -> list[float]:
    """This rank's peak resident memory (MiB) above its value before the model is built: during three
    training steps (the figure a device's peak memory stands for) and during set-up (building and,
    for ours, capturing and compiling), gathered to rank 0. Fresh processes per variant; between
    set-up and training, freed heap is returned to the system for every variant alike."""
    import torch.distributed as dist

    global PEERS_FUSED
    PEERS_FUSED = peers_fused
    import nnscaler_plugins  # noqa: F401  (imported before the baseline: the import is not the model's memory)
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401

    _load_tracing_code()
    _trim_and_reset_peak()
    start = _rss_mib("VmRSS")
    step = build(name, rank)
    setup = _rss_mib("VmHWM") - start
    _trim_and_reset_peak()
    for _ in range(3):
        step()
    grown = torch.tensor([_rss_mib("VmHWM") - start, setup])
    out = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(out, grown)
    return [tuple(t.tolist()) for t in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (each runs every variant once)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile pair")
    ap.add_argument("--no-memory", action="store_true", help="time only")
    ap.add_argument("--peers-fused", action="store_true", help="the peers' AdamW with fused=True, as ours")
    ap.add_argument("--only", default="", help="only the pairs whose side of ours names this (e.g. eager)")
    ap.add_argument("--memory-runs", type=int, default=3,
                    help="fresh sets of processes per variant for memory; each figure is the median over them")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    r = common.spawn(bench, WORLD, args.iters, not args.no_compile, args.peers_fused, args.only)
    times, losses, notes = r["times"], r["losses"], r["notes"]
    memory, largest = {}, {}
    if not args.no_memory:
        runs: dict[str, list] = {name: [] for name in times}
        for _ in range(args.memory_runs):  # the variants in turn, so a drift of the host's state reaches all alike
            for name in times:
                runs[name].append(common.spawn(bench_memory, WORLD, name, args.peers_fused))
        # per rank, the median over the runs of its training and set-up peaks; the ratio below is of the
        # median over the runs of the largest rank's peak (one allocator's timing moves a run by a few MiB)
        memory = {name: [tuple(statistics.median(run[r][i] for run in rs) for i in range(2)) for r in range(WORLD)]
                  for name, rs in runs.items()}
        largest = {name: statistics.median(max(m[0] for m in run) for run in rs) for name, rs in runs.items()}
    rows = []
    for peer, ours in pairs(args.only):
        if peer not in times:
            continue
        mine = ours if ours in times else ours.replace(" compiled", "")
        ratio = statistics.median(times[peer]) / statistics.median(times[mine])
        paired = statistics.median(a / b for a, b in zip(times[peer], times[mine]))
        mem = lambda n: (" / ".join(f"{m[0]:.0f}" for m in memory[n])  # noqa: E731
                         + f" ({max(m[1] for m in memory[n]):.0f})") if n in memory else "-"
        peak = largest.__getitem__
        mem_ratio = f"{peak(peer) / peak(mine):.3f}" if peer in memory and mine in memory else "-"
        fused_peer = args.peers_fused and peer == "DDP"  # see _fused_runs
        rows.append((peer + (", fused AdamW" if fused_peer else ""), mine + (" (eager: see note)" if mine != ours else ""),
                     f"{statistics.median(times[peer]) * 1e3:.0f}", f"{statistics.median(times[mine]) * 1e3:.0f}",
                     f"{ratio:.3f}", f"{paired:.3f}", mem(peer), mem(mine), mem_ratio,
                     f"{losses[peer]:.5f} / {losses[mine]:.5f}"))
        print(rows[-1], flush=True)
    load_after = os.getloadavg()[0]
    note = (f"GPT-2 shape: {LAYERS} layers, {DIM} wide, {HEADS} heads, vocabulary {VOCAB}, sequence {SEQ}, global "
            f"batch {BATCH} ({BATCH // WORLD} per rank data-parallel; all {BATCH} on every rank under tp); AdamW (ours "
            f"fused, the peers' {'fused for DDP, torch default for the DTensor peers' if args.peers_fused else 'torch default'}); "
            f"{args.iters} timed iterations, each running every variant once in rotating order, steps fenced by "
            f"barriers; load average {load_before:.1f} before, {r['load']:.1f} during, {load_after:.1f} after "
            f"(2 shared cores). Memory: each rank's peak RSS during three training steps above its RSS before the "
            f"model is built (MiB, ranks 0 / 1 / 2 / 3; fresh processes per variant; freed heap returned to the "
            f"system after set-up for every variant alike; each figure the median over {args.memory_runs} such runs), "
            f"and in brackets the largest peak of set-up (building, and for ours capture and compile) above the same "
            f"base. Ratio of memory: the median over the runs of the peer's largest training peak over ours'.")
    for name, why in notes.items():
        note += f" {name}: {why}."
    print(common.record(f"step_speed.py: ours vs DDP, FSDP2 (eager, compiled) and DTensor tp, {WORLD} gloo processes "
                        "(train step)", rows,
                        ("peer", "ours", "peer ms (median)", "ours ms (median)", "ratio of medians peer/ours",
                         "median of paired ratios", "peer peak MiB in training (set-up)",
                         "ours peak MiB in training (set-up)", "ratio of memory peer/ours",
                         "first loss peer / ours"), note, keep_previous=True))  # the ratios' change is the point


if __name__ == "__main__":
    main()
