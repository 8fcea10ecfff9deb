"""How long the search takes on this machine: capture plus search, wall clock.

Targets (issue 4): GPT-3 175B (an HF GPT-2 configuration with 96 layers, hidden 12288, built on the
meta device, sequence 2048, global batch 1536) on 1,024 GPUs in at most 60 s; 64-GPU cases in at most
10 s; on each preset given (the A100 preset prices with the 2021 stack, H100 and H200 with today's:
kernel tables and overlap). The progress bar is off so that only the search is timed.

    python benchmarks/search_time.py                               # a100-dgx, h100-dgx, h200; appended to RESULTS.md
    python benchmarks/search_time.py --clusters h100-dgx --only 175B
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--only", help="substring of a case name")
    ap.add_argument("--clusters", default="a100-dgx,h100-dgx,h200", help="comma-separated presets")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
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
