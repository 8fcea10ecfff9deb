"""Shared bits of the benchmarks: the model under test, timing, and appending to RESULTS.md."""
from __future__ import annotations

import datetime
import gc
import os
import platform
import queue
import socket
import statistics
import time
from typing import Callable, NamedTuple, Sequence

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def gpt2(n_layer: int = 4, n_embd: int = 256, n_head: int = 8, vocab: int = 2048, seed: int = 0, positions: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=positions,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def llama(n_layer: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 4, vocab: int = 2048, seed: int = 0,
          positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=hidden * 4, vocab_size=vocab,
                      max_position_embeddings=positions, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def batch(b: int, s: int, vocab: int = 2048, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids}


# -- one device, world 1 (the one-GPU benchmarks) -----------------------------------------------
def env_world_one() -> None:
    """The launcher variables of a one-process job, so parallelize opens the process group itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    """Frees what is cached and restarts the GPU's peak-memory count (no-op without a GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else float("nan")


class Paired(NamedTuple):
    """Two alternating step timings: the median seconds of each, their ratio and the per-step view."""

    a: float  # median seconds of a step of a
    b: float  # median seconds of a step of b
    ratio: float  # median(a) / median(b): the ratio every benchmark reports
    per_step: float  # median over step pairs of a / b (beside it: how steady the pairing was)

    def cells(self, digits: int = 3) -> tuple[str, str]:
        """The two ratios as table cells: the ratio of medians, and the median per-step ratio."""
        return f"{self.ratio:.{digits}f}", f"{self.per_step:.{digits}f}"


def paired_ratio(times_a: Sequence[float], times_b: Sequence[float]) -> Paired:
    """`Paired` of two lists of step times taken pairwise (same length, step i of a beside step i of b)."""
    if len(times_a) != len(times_b) or not times_a:
        raise ValueError(f"paired timings need two lists of the same non-zero length (got {len(times_a)} and "
                         f"{len(times_b)})")
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    return Paired(ma, mb, ma / mb, statistics.median(a / b for a, b in zip(times_a, times_b)))


def time_paired(step_a: Callable[[], None], step_b: Callable[[], None], warmup: int = 3, iters: int = 20,
                sync: Callable[[], None] = lambda: None) -> Paired:
    """Median step times of a and b and their ratio (`Paired`).

    The two steps alternate (a, b, a, b, ...), so slow phases of a shared machine hit both alike.
    The ratio reported is the ratio of the two medians (what a user's run of many steps sees); the
    median of the per-pair ratios comes beside it (near the ratio of medians when the pairing is
    steady; it is not the speed ratio when a few steps of one side are slow).
    """
    for _ in range(warmup):
        step_a()
        step_b()
    sync()
    ta, tb = [], []
    for i in range(iters):
        for step, out in ((step_a, ta), (step_b, tb)) if i % 2 == 0 else ((step_b, tb), (step_a, ta)):
            t = time.perf_counter()
            step()
            sync()
            out.append(time.perf_counter() - t)
    return paired_ratio(ta, tb)


def machine() -> str:
    gpu = ""
    if torch.cuda.is_available():
        gpu = f", {torch.cuda.get_device_name(0)}"
    return f"{platform.machine()} {os.cpu_count()} cores{gpu}, torch {torch.__version__}, host {socket.gethostname()}"


def recorded_section(title: str) -> list[str]:
    """The lines of RESULTS.md's section `title` as `record` last wrote it (empty when absent), so
    a script rerun over part of its cases can keep the rows of the others."""
    if not os.path.exists(RESULTS):
        return []
    text = open(RESULTS).read()
    at = text.find(f"## {title}\n")
    if at < 0:
        return []
    end = text.find("\n## ", at + 1)
    return text[at:end if end >= 0 else len(text)].splitlines()


def record(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...], notes: str = "",
           keep_previous: bool = False) -> str:
    """Write a dated table into RESULTS.md under `## title` and return it as text.

    A section with the same title is replaced (the file holds each benchmark's latest run; git
    keeps the history), any other section is left as it is. With `keep_previous` the new dated
    table goes on top of the section and the earlier ones stay below it (results whose change
    over time is the point: the search's plans as the cost model improves)."""
    date = datetime.date.today().isoformat()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"## {title}", "", f"{date}, {machine()}, load average {load:.1f} when written", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if notes:
        lines += ["", notes]
    text = "\n".join(lines) + "\n\n"
    old = open(RESULTS).read() if os.path.exists(RESULTS) else \
        "# Benchmark results\n\nEach section is written by the script named in its title.\n\n"
    head = f"## {title}\n"
    start = old.find(head) if old.startswith(head) else old.find("\n" + head)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        start += 0 if old.startswith(head) and start == 0 else 1
        end = old.find("\n## ", start + len(head))
        if keep_previous:
            earlier = old[start + len(head):end if end >= 0 else len(old)].strip("\n")
            text = text.rstrip("\n") + "\n\n" + earlier + "\n\n"
        new = old[:start] + text + (old[end + 1:] if end >= 0 else "")
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        f.write(new.rstrip("\n") + "\n")
    os.replace(tmp, RESULTS)
    return text


def _exit_with_parent(parent: int) -> None:
    """End this worker when the benchmark that started it is gone (killed, or interrupted before it
    joined its workers): a worker left waiting in a collective would hold its cores and memory, and
    every later measurement on the machine, until someone kills it by hand."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker(rank: int, world: int, port: int, fn, args, q, result_rank: int = 0, parent: int = 0) -> None:
    import torch.distributed as dist

    if parent:
        _exit_with_parent(parent)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        if rank == result_rank:
            q.put(out)
    finally:
        dist.destroy_process_group()


def spawn_last(fn, world: int, *args):
    """As `spawn`, returning the last rank's result (where a pipeline computes its loss)."""
    return _spawn(fn, world, args, world - 1)


def spawn(fn, world: int, *args):
    """Run fn(rank, world, *args) in `world` gloo processes; return rank 0's result."""
    return _spawn(fn, world, args, 0)


def _spawn(fn, world: int, args: tuple, result_rank: int):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q, result_rank, os.getpid()))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    while True:  # a worker that died (its traceback is on stderr) ends the wait, not the 30-minute limit
        try:
            out = q.get(timeout=2.0)
            break
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{getattr(fn, '__name__', fn)}: worker(s) {dead} exited with an error"
                                   if dead else f"{getattr(fn, '__name__', fn)}: no result within 30 minutes")
    for p in procs:
        p.join()
    return out
