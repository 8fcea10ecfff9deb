"""How long the search takes on this machine: capture plus search, wall clock.

Targets: GPT-3 175B (an HF GPT-2 configuration with 96 layers, hidden 12288, built on the
meta device, sequence 2048, global batch 1536) on 1,024 GPUs in at most 60 s; 64-GPU cases in at most
10 s; on each preset given (the A100 preset prices with the 2021 stack, H100 and H200 with today's:
kernel tables and overlap). The progress bar is off so that only the search is timed.

    python benchmarks/search_time.py                               # a100-dgx, h100-dgx, h200; appended to RESULTS.md
    python benchmarks/search_time.py --clusters h100-dgx --only 175B

Pricing one published configuration: `--published` captures, plans (`nns.plan` with the
configuration's strategy and options) and simulates each of the largest published runs in PUBLISHED,
target at most 10 s each, capture included; then, on the Llama-3-405B graph captured once, how the
planning and the pricing grow with pipeline stages, micro-batches and data-parallel replicas (CPU
seconds, which the other processes on a shared machine do not inflate as they do wall clock).
Medians of `--repeats` runs.

    python benchmarks/search_time.py --published                   # appended to RESULTS.md
    python benchmarks/search_time.py --published --only 405B --repeats 1 --no-scaling
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import record  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402
from nnscaler_plugins.capture.experts import experts_as_one_op  # noqa: E402


def gpt(layers, hidden, heads, vocab=50257, seq=2048):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def llama(layers, hidden, heads, inter, vocab=32000, seq=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


CASES = [
    # (name, builder, world, global batch, target seconds)
    ("GPT-3 175B (96 x 12288, seq 2048)", lambda: gpt(96, 12288, 96), 1024, 1536, 60.0),
    ("GPT 3.6B (C1 row: 30 x 3072)", lambda: gpt(30, 3072, 32, vocab=51200), 64, 512, 10.0),
    ("Llama-2 7B shape (32 x 4096)", lambda: llama(32, 4096, 32, 11008), 64, 512, 10.0),
    ("GPT-2 1.5B (48 x 1600, seq 1024)", lambda: gpt(48, 1600, 25, seq=1024), 64, 512, 10.0),
    # expert and context parallelism in the space: experts captured as one op (ep), 32k-token attention (cp)
    ("Mixtral-8x7B shape, ep searched (32 x 4096, seq 4096)", lambda: _part_c().mixtral_8x7b(), 64, 256, 10.0),
    ("Llama-8B shape, cp searched (32 x 4096, seq 32k)", lambda: _part_c().llama_8b(32768), 64, 8, 10.0),
]
WHOLE_EXPERTS = ("ep searched",)  # cases captured with each mixture-of-experts layer as one op


def _part_c():
    import plan_quality

    return plan_quality


def llama3_405b(seq: int = 8192):
    """Llama 3 405B's shape (126 layers, 16,384 wide, 128 heads, 8 key/value heads, FFN 53,248,
    vocabulary 128,256) as transformers' Llama, one sequence of `seq` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=126, hidden_size=16384, num_attention_heads=128, num_key_value_heads=8,
                      intermediate_size=53248, vocab_size=128256, max_position_embeddings=seq, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def llama3_405b_long(seq: int = 131072):
    """The same shape written out with causal SDPA (transformers' Llama captured on the meta device
    carries a materialized mask tensor, which keeps the sequence whole under cp)."""
    with torch.device("meta"):
        model = _part_c().Decoder(vocab=128256, d=16384, heads=128, kv_heads=8, ffn=53248, layers=126)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def deepseek_v3(seq: int = 4096):
    """DeepSeek-V3's shape (transformers' default DeepseekV3Config: 61 layers, the first 3 dense, 256 routed
    experts top-8 and one shared expert, multi-head latent attention, 671B parameters)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(use_cache=False, max_position_embeddings=seq)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


LLAMA3 = "Llama 3 paper (Dubey et al., arXiv 2407.21783), Table 4"
DEEPSEEK_V3 = "DeepSeek-V3 technical report (arXiv 2412.19437), section 3.2"
PUBLISHED = [
    # (name, source, builder, strategy, world, options, experts as one op); one micro-batch of one sequence
    ("Llama 3 405B, seq 8192: tp 8, pp 16 interleaved, dp 64, 32 micro-batches, SP", LLAMA3, llama3_405b,
     "megatron", 8192, dict(tp=8, pp=16, virtual_stages=2, micro_batches=32, sequence_parallel=True), False),
    ("Llama 3 405B, seq 8192: tp 8, pp 16 interleaved, dp 128, 16 micro-batches, SP", LLAMA3, llama3_405b,
     "megatron", 16384, dict(tp=8, pp=16, virtual_stages=2, micro_batches=16, sequence_parallel=True), False),
    # megatron's cp= keeps Megatron's rank order (tp inside a node), as Llama 3 ran it; sequence parallelism
    # with cp is refused for now
    ("Llama 3 405B, seq 131072: tp 8, cp 16 (ring), pp 16 interleaved, dp 8, 16 micro-batches", LLAMA3,
     llama3_405b_long, "megatron", 16384, dict(tp=8, cp=16, pp=16, virtual_stages=2, micro_batches=16,
                                                cp_comm="p2p"), False),
    # DeepSeek ran the dense part data-parallel inside each stage (DualPipe, ZeRO-1); with pp > 1 megatron's
    # ep= lays the dense part out as strategy "ep" does (strategies/expert_parallel.py): the nearest it writes
    ("DeepSeek-V3 671B, seq 4096: ep 64, pp 16 (1F1B), dp 2, 16 micro-batches, ZeRO-1", DEEPSEEK_V3, deepseek_v3,
     "megatron", 2048, dict(ep=64, pp=16, micro_batches=16, zero=1), True),
]


def _timed(fn):
    """(result, wall s, CPU s of this process)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def published(args) -> None:
    import statistics

    rows = []
    for name, source, build, strategy, world, options, whole in PUBLISHED:
        if args.only and args.only not in name:
            continue
        runs = []
        for _ in range(args.repeats):
            model, inputs = build()
            with experts_as_one_op(model) if whole else contextlib.nullcontext():
                graph, cw, cc = _timed(lambda: nns.capture(model, kwargs=inputs))
            plan, pw, pc = _timed(lambda: nns.plan(graph, strategy=strategy, world_size=world, **options))
            est, sw, sc = _timed(lambda: nns.simulate(plan, nns.cluster("h100-dgx", nodes=world // 8)))
            runs.append((cw, pw, sw, cc, pc, sc))
            ops = len(graph.ops)
            del model, graph
        med = [statistics.median(r[i] for r in runs) for i in range(6)]
        total = statistics.median(r[0] + r[1] + r[2] for r in runs)
        rows.append((name, source, f"{world}", f"{ops}",
                     f"{med[0]:.1f}", f"{med[1]:.1f}", f"{med[2]:.1f}", f"**{total:.1f}**",
                     f"{med[3]:.1f} / {med[4]:.1f} / {med[5]:.1f}", "<= 10", "yes" if total <= 10 else "NO",
                     f"{est.step_time_s:.3g} s, {est.peak_memory_gib:.0f} GiB"))
        print(" | ".join(rows[-1]), flush=True)
    if rows and not args.no_record:
        record("search_time.py --published: one published configuration captured, planned and priced", rows,
               ("configuration", "source", "GPUs", "ops", "capture s", "plan s", "price s", "total s",
                "CPU s (capture / plan / price)", "target", "met", "estimate (h100-dgx)"),
               f"Wall clock on 2 CPU cores shared with other work (medians of {args.repeats} runs, each from a "
               "fresh meta-device model), progress off: `nns.capture`, `nns.plan(graph, strategy=..., "
               "world_size=..., **options)` (a unit of more than 64 devices is not lowered by nns.plan), "
               "`nns.simulate` on the h100-dgx preset. The estimate's step time and peak memory are "
               "what the simulator says today, not a fidelity claim. Load average "
               f"{os.getloadavg()[0]:.1f} when written.", keep_previous=True)
    if not args.no_scaling:
        scaling(args)


def _price_cpu(graph, world: int, pp: int, micro: int, chunks: int) -> tuple[float, float]:
    """CPU seconds to plan (strategy + validation, not lowered) and to simulate one megatron configuration."""
    from nnscaler_plugins.plan.primitives import PlanBuilder
    from nnscaler_plugins.plugins import get_strategy

    strategy = get_strategy("megatron")
    opts = dict(tp=8, pp=pp, virtual_stages=chunks, sequence_parallel=True)

    def make():
        unit, dp = strategy.degrees(world, **opts)
        builder = PlanBuilder(graph, unit, dp, strategy="megatron", options=opts, micro_batches=micro)
        strategy(builder, **opts)
        return builder.finish()

    plan, _, pc = _timed(make)
    _, _, sc = _timed(lambda: nns.simulate(plan, nns.cluster("h100-dgx", nodes=world // 8)))
    return pc, sc


SCALING = [
    # (what varies, world, pp, micro-batches, chunks per rank)
    ("replicas", 1024, 16, 16, 2), ("replicas", 8192, 16, 16, 2), ("replicas", 16384, 16, 16, 2),
    ("replicas", 131072, 16, 16, 2),
    ("micro-batches", 8192, 16, 16, 2), ("micro-batches", 8192, 16, 64, 2), ("micro-batches", 8192, 16, 256, 2),
    ("micro-batches", 8192, 16, 1024, 2),
    ("stages", 4096, 8, 64, 2), ("stages", 8192, 16, 64, 2), ("stages", 16384, 32, 64, 2),
    ("stages", 16128, 63, 63, 2),
]


def scaling(args) -> None:
    import statistics

    model, inputs = llama3_405b()
    graph = nns.capture(model, kwargs=inputs)
    _price_cpu(graph, 8192, 16, 16, 2)  # the graph's per-op cost table, made once per graph, out of the rows
    rows = []
    for what, world, pp, micro, chunks in SCALING:
        runs = [_price_cpu(graph, world, pp, micro, chunks) for _ in range(args.repeats)]
        p, s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        rows.append((what, f"{world}", f"{world // (8 * pp)}", f"{pp} x {chunks}", f"{micro}",
                     f"{pp * chunks * micro * 2}", f"{p:.2f}", f"{s:.2f}"))
        print(" | ".join(rows[-1]), flush=True)
    if not args.no_record:
        record("search_time.py --published: how planning and pricing grow (Llama 3 405B, tp 8, SP)", rows,
               ("varied", "GPUs", "dp", "pp x chunks", "micro-batches", "pipeline tasks", "plan CPU s",
                "price CPU s"),
               f"CPU seconds of this process (medians of {args.repeats}), the 126-layer graph captured once and its "
               "per-op cost table made before the rows: planning is the megatron strategy on a PlanBuilder "
               "plus validation (no lowering, as nns.plan for units over 64 devices), pricing is nns.simulate. "
               "Replicas enter only the collectives' cost formulas; micro-batches and stages enter through "
               "the schedule's task lists (2 x pp x chunks x micro-batches tasks), replayed in linear time.",
               keep_previous=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--only", help="substring of a case name")
    ap.add_argument("--clusters", default="a100-dgx,h100-dgx,h200", help="comma-separated presets")
    ap.add_argument("--published", action="store_true", help="price the largest published configurations")
    ap.add_argument("--repeats", type=int, default=3, help="--published: runs per row (medians)")
    ap.add_argument("--no-scaling", action="store_true", help="--published: without the growth rows")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.published:
        published(args)
        return
    rows = []
    for name, build, world, batch, target in CASES:
        if args.only and args.only not in name:
            continue
        for preset in args.clusters.split(","):
            tb = time.perf_counter()
            model, inputs = build()  # the user's model on the meta device: not part of the timed work
            t0 = time.perf_counter()
            with experts_as_one_op(model) if any(w in name for w in WHOLE_EXPERTS) else contextlib.nullcontext():
                graph = nns.capture(model, kwargs=inputs)
            t1 = time.perf_counter()
            spec = nns.cluster(preset, nodes=world // 8)
            plans = nns.search(graph, world_size=world, cluster=spec, global_batch_size=batch, progress=False)
            t2 = time.perf_counter()
            rows.append(_row(name, preset, world, batch, graph, plans, tb, t0, t1, t2, target))
            print(" | ".join(rows[-1]), flush=True)
    if not args.no_record:
        record("search_time.py: capture + search on this machine (A100, H100 and H200 presets)", rows,
               ("model", "cluster", "GPUs", "global batch", "ops", "model built s", "capture s", "search s", "total s",
                "target", "met", "frontier plans", "candidates priced", "fastest plan found"),
               "Wall clock on 2 CPU cores, progress bar off; the total is capture plus search (building the "
               "model on the meta device, the user's own code, is shown apart). Capture traces two layers of the "
               "repeated stack with torch.export and writes the others as copies (nnscaler_plugins/capture/repeated_layers.py; "
               "the op count is the full model's). The search solves one layer per device-group size "
               "(identical layers once), prices every inter-op candidate from the solved segments, and simulates "
               "(full timeline replay) the ten nearest the frontier. Each preset prices with its kernel table and "
               f"stack (search/cluster.py); load average {os.getloadavg()[0]:.1f} when written.", keep_previous=True)


def _row(name, preset, world, batch, graph, plans, tb, t0, t1, t2, target) -> tuple:
    best = plans.estimates[0]
    total = t2 - t0
    return (name, preset, f"{world}", f"{batch}", f"{len(graph.ops)}", f"{t0 - tb:.1f}", f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
            f"**{total:.1f}**", f"<= {target:.0f}", "yes" if total <= target else "NO", f"{len(plans)}",
            f"{plans.searched}", f"{best.step_time_s:.3g} s, {best.peak_memory_gib:.1f} GiB: {plans.best.options['summary']}")


if __name__ == "__main__":
    main()
