"""Plan quality, measured by the simulator: does the search beat the published and the fixed plans?

Part A: for every configuration of C1 and C2 (docs/cost-model.md) the search runs on the same
graph (the published micro-batch), world size, global batch and cluster, with the published plan's
simulated peak memory as its memory limit; the fastest plan it returns must be at least as fast as
the published plan, simulated the same way.

Part B: on a GPT with a 256k vocabulary, a windowed-attention (Swin-style) vision model and a
mixture-of-experts model, the search's fastest plan against the best of three fixed recipes (pure
data parallelism, ZeRO-3, Megatron tensor parallelism within a node with data parallelism across),
all at the same memory limit. Target: 1.3x, or an explanation of why not (printed in the notes).

Part C: expert and context parallelism in the search. A Mixtral-8x7B-shaped model (experts captured
as one op each, so splitting them with their tokens is in the space) searched with ep available,
against the best plan the search finds without ep (`MaxExpertParallel(1)`) and against the
Megatron-style recipe (ep 8 within a node with tp 8 for attention and the dense layers, data
parallelism across nodes, ZeRO-1). And a Llama-8B-shaped model at 32k and 128k tokens per sequence on
8 to 64 H100s, searched with context parallelism (cp degree and cp_comm in the space) against the best
plan without it (`MaxContextParallel(1)`).

    python benchmarks/plan_quality.py [--part A|B|C] [--quick]   # appended to RESULTS.md
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import calibration as C  # noqa: E402
from common import record  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402
from nnscaler_plugins.plan.primitives import PlanBuilder  # noqa: E402
from nnscaler_plugins.plugins import get_strategy  # noqa: E402
from nnscaler_plugins.search.costmodel import CostModel  # noqa: E402
from nnscaler_plugins.search.solver import SearchError  # noqa: E402

GiB = 1024 ** 3


# -- part A ---------------------------------------------------------------------------------------------------
def part_a(quick: bool, save: bool = True) -> None:
    rows = []
    cases = [c for c in C.cases() if c.source in ("C1", "C2 full", "C2 selective")]
    if quick:
        cases = [c for c in cases if c.world <= 512]
    for case in cases:
        t0 = time.time()
        g = C.graph(case.model, case.micro_batch)
        spec = nns.cluster(case.cluster, nodes=C.nodes_for(case))
        cm = CostModel(g, spec)
        published = nns.simulate(C.published_plan(case, g), spec, cost_model=cm)
        try:
            # the published plans with sequence parallelism: the search may use the same option for those
            # rows (its plans are priced with it; the megatron strategy's plans also execute it)
            plans = nns.search(g, world_size=case.world, cluster=spec, global_batch_size=case.batch,
                               memory_limit=published.max_memory_bytes, progress=False,
                               sequence_parallel=bool(case.options.get("sequence_parallel")))
            best = plans.estimates[0]
            found = (f"{best.step_time_s:.3f}", f"{best.peak_memory_gib:.1f}",
                     f"{published.step_time_s / best.step_time_s:.2f}x",
                     "yes" if best.step_time_s <= published.step_time_s * (1 + 1e-9)
                     and best.max_memory_bytes <= published.max_memory_bytes else "NO",
                     plans.best.options["summary"])
        except SearchError as e:
            found = ("-", "-", "-", "NO", str(e)[:120])
        rows.append((case.source, case.name, f"{case.world}", f"{case.batch}", f"{published.step_time_s:.3f}",
                     f"{published.peak_memory_gib:.1f}") + found + (f"{time.time() - t0:.0f}",))
        print(" | ".join(rows[-1]), flush=True)
    met = sum(1 for r in rows if r[9] == "yes")
    if save:
        record("plan_quality.py part A: search vs the published C1/C2 plans (simulated, same memory)", rows,
               ("source", "model", "GPUs", "batch", "published s", "published GiB", "search s", "search GiB", "speed-up",
            "at least as fast, within memory", "fastest plan found", "wall s"),
           f"{met} of {len(rows)} configurations met. Memory limit of each search: the published plan's simulated "
               "peak. Both sides are priced by the same simulator (benchmarks/simulator_fidelity.py reports how close "
               "it is to the published measurements). For the C2 rows with sequence parallelism the search may use "
               "that option too (`nns.search(..., sequence_parallel=True)`): its candidates carry the layers' "
               "sequence splits and are priced as placed, as the `megatron` strategy's plans are.", keep_previous=True)


# -- part B ---------------------------------------------------------------------------------------------------
def gpt_256k():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=24, n_embd=2048, n_head=16, vocab_size=256000, n_positions=2048, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


class WindowAttention(torch.nn.Module):
    def __init__(self, d, heads, window):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.bias = torch.nn.Parameter(torch.zeros(heads, window * window, window * window))

    def forward(self, x):  # [B, H, W, C]
        b, h, w, c = x.shape
        ws, nh = self.window, self.heads
        win = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        n = win.shape[0]
        q, k, v = self.qkv(win).view(n, ws * ws, 3, nh, c // nh).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // nh) ** -0.5 + self.bias, dim=-1)
        y = self.proj((att @ v).transpose(1, 2).reshape(n, ws * ws, c))
        return y.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class SwinBlock(torch.nn.Module):
    def __init__(self, d, heads, window):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = WindowAttention(d, heads, window)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class Swin(torch.nn.Module):
    """Windowed attention over a 56 x 56 token grid (224 px, patch 4), uniform width."""

    def __init__(self, d=1024, heads=32, window=7, depth=24, classes=1000):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d, kernel_size=4, stride=4)
        self.blocks = torch.nn.ModuleList(SwinBlock(d, heads, window) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, pixels, labels):
        x = self.patch(pixels).permute(0, 2, 3, 1)
        for blk in self.blocks:
            x = blk(x)
        return torch.nn.functional.cross_entropy(self.head(self.norm(x).mean(dim=(1, 2))), labels)


def swin():
    with torch.device("meta"):
        model = Swin()
    return model, {"pixels": torch.zeros(8, 3, 224, 224, device="meta"),
                   "labels": torch.zeros(8, dtype=torch.long, device="meta")}


class MoELayer(torch.nn.Module):
    """Switch-style top-1 routing with a fixed capacity per expert (static shapes)."""

    def __init__(self, h, f, experts, capacity):
        super().__init__()
        self.e, self.cap = experts, capacity
        self.norm = torch.nn.LayerNorm(h)
        self.router = torch.nn.Linear(h, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, h, f) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(experts, f, h) * 0.02)

    def forward(self, x):
        b, s, h = x.shape
        t = self.norm(x.reshape(b * s, h))
        gates = torch.softmax(self.router(t), dim=-1)
        mask = torch.nn.functional.one_hot(gates.argmax(dim=-1), self.e).to(t.dtype)
        pos = torch.cumsum(mask, dim=0) * mask
        slot = torch.nn.functional.one_hot((pos - 1).clamp(min=0).long(), self.cap).to(t.dtype)
        disp = slot * ((pos > 0) & (pos <= self.cap)).to(t.dtype).unsqueeze(-1)  # tokens x experts x capacity
        hidden = torch.nn.functional.gelu(torch.bmm(disp.permute(1, 2, 0) @ t, self.w1))
        out = torch.bmm(hidden, self.w2)  # experts x capacity x h
        y = (disp * (gates * mask).unsqueeze(-1)).reshape(b * s, -1) @ out.reshape(-1, h)
        return x + y.reshape(b, s, h)


class MoE(torch.nn.Module):
    def __init__(self, vocab=32000, h=2048, f=8192, experts=32, layers=12, seq=2048, batch=2, cf=1.25):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(MoELayer(h, f, experts, int(cf * batch * seq / experts))
                                          for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def moe():
    with torch.device("meta"):
        model = MoE()
    ids = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def recipe(graph, name: str, world: int, m: int, **opts):
    """A fixed recipe as a plan (built directly, no lowering)."""
    strategy = get_strategy("megatron" if name == "megatron" else "dp")
    # a router's statistics per micro-batch, as Megatron computes its auxiliary loss (pricing is the same)
    stats = {"batch_statistics": "local"} if m > 1 else {}
    if name == "megatron":
        unit, dp = strategy.degrees(world, tp=8, pp=1)
        builder = PlanBuilder(graph, unit, dp, strategy="megatron", micro_batches=m)
        strategy(builder, tp=8, pp=1, **stats)
    else:
        builder = PlanBuilder(graph, 1, world, strategy="dp", micro_batches=m)
        strategy(builder, **stats)
    plan = builder.finish()
    plan.zero = 3 if name == "zero-3" else 0
    return plan


MODELS = [("GPT, 24 x 2048, vocabulary 256k", gpt_256k, 32, 256),
          ("Swin-style windowed attention, 24 x 1024, 56x56 tokens", swin, 32, 1024),
          ("MoE, 12 layers x 32 experts (top-1), 2048 hidden", moe, 32, 256)]


def part_b(limits=(80 * GiB, 24 * GiB), save: bool = True, clusters=("a100-dgx", "h100-dgx")) -> None:
    rows = []
    for (name, build, world, batch), preset in [(m, c) for m in MODELS for c in clusters]:
        model, inputs = build()
        g = nns.capture(model, kwargs=inputs)
        b = next(t.shape[0] for t in inputs.values())
        spec = nns.cluster(preset, nodes=world // 8)
        cm = CostModel(g, spec)
        base = {}
        for r, dp in (("dp", world), ("zero-3", world), ("megatron", world // 8)):
            m = batch // (b * dp)
            base[r] = nns.simulate(recipe(g, r, world, m), spec, cost_model=cm)
        for limit in limits:
            fits = {r: e for r, e in base.items() if e.max_memory_bytes <= limit}
            best_r = min(fits.items(), key=lambda kv: kv[1].step_time_s) if fits else None
            try:
                plans = nns.search(g, world_size=world, cluster=spec, global_batch_size=batch, memory_limit=limit,
                                   progress=False)
                s = plans.estimates[0]
                summary = plans.best.options["summary"]
            except SearchError as e:
                s, summary = None, str(e)[:100]
            recipes = "; ".join(f"{r} {e.step_time_s:.3g} s / {e.peak_memory_gib:.1f} GiB"
                                + ("" if e.max_memory_bytes <= limit else " (over)") for r, e in base.items())
            speed = (f"{best_r[1].step_time_s / s.step_time_s:.2f}x" if best_r and s else
                     ("no recipe fits" if s else "-"))
            # the model's ops alone, spread evenly (data parallelism does no redundant work): no communication,
            # no bubble, no optimizer step -- every plan does at least this much per device
            bound = base["dp"].compute_s - base["dp"].details.get("optimizer_s", 0.0)
            rows.append((name, preset, f"{world}", f"{batch}", f"{limit / GiB:.0f}", f"{bound:.3g} s", recipes,
                         f"{best_r[0]} {best_r[1].step_time_s:.3g} s" if best_r else "none fits",
                         f"{s.step_time_s:.3g} s / {s.peak_memory_gib:.1f} GiB" if s else "-", speed, summary))
            print(" | ".join(rows[-1]), flush=True)
    if save:
        record("plan_quality.py part B: search vs fixed recipes at the same memory limit (simulated, A100 and H100 "
               "presets)", rows,
           ("model", "cluster", "GPUs", "global batch", "memory limit GiB", "compute-only bound", "recipes (time / peak)",
            "best fitting recipe",
            "search best", "speed-up (target 1.3x)", "search's plan"),
           NOTES_B, keep_previous=True)


NOTES_B = """Recipes: pure data parallelism (ZeRO 0), ZeRO-3 (the same with sharded states), and Megatron tensor
parallelism over the 8 GPUs of a node with data parallelism across nodes; none recomputes. All plans
use the graph's micro-batch and the same global batch (micro-batches = batch / (micro-batch x data
parallelism)). "Compute-only bound" is the op time per device of the data-parallel plan, without its
communication, bubble or optimizer step: the model's work spread evenly over the devices, which every
plan must at least do, so a 1.3x speed-up over a recipe is only possible where that recipe takes more
than 1.3x the bound. Where the speed-up is below 1.3x, that is why: the GPT with a 256k vocabulary and the
windowed-attention model are compute-bound under data parallelism (their weights are small next to
their activations and FLOPs, so data parallelism's gradient all-reduce hides under the backward), the
best fitting recipe is already within a few percent of the bound, and the search's margin is what is
left (ZeRO-2 sharding that costs no time, cheaper gradient reduction). The mixture-of-experts model is
not: its expert weights make data parallelism run out of memory and ZeRO-3 pay for gathering them at
every micro-batch, and the search's mix of expert splits and pipelining wins by far."""


# -- part C ---------------------------------------------------------------------------------------------------
def mixtral_8x7b(layers: int = 32, seq: int = 4096):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


class DecoderBlock(torch.nn.Module):
    """Llama's block: RMSNorm, grouped-query causal attention (SDPA), SwiGLU."""

    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = torch.nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.gate = torch.nn.Linear(d, ffn, bias=False)
        self.up = torch.nn.Linear(d, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        y = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


class Decoder(torch.nn.Module):
    def __init__(self, vocab=128256, d=4096, heads=32, kv_heads=8, ffn=14336, layers=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(DecoderBlock(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def llama_8b(seq: int, layers: int = 32):
    """Llama-3-8B's shapes written out (transformers' Llama captured on the meta device carries a
    materialized causal mask tensor, which keeps the sequence whole; this calls SDPA with is_causal)."""
    with torch.device("meta"):
        model = Decoder(layers=layers)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def ep_recipe(graph, world: int, m: int):
    """Megatron-Core's grouping for MoE: ep 8 and tp 8 over the GPUs of a node, dp across, ZeRO-1."""
    strategy = get_strategy("ep")
    unit, dp = strategy.degrees(world, ep=8, tp=8)
    builder = PlanBuilder(graph, unit, dp, strategy="ep", micro_batches=m)
    # the router's top-k reads every token of a replica; the recipe computes it per replica, as Megatron does
    strategy(builder, ep=8, tp=8, batch_statistics="local")
    plan = builder.finish()
    plan.zero = 1
    return plan


def _best(graph, world, spec, batch, limit, constraints=(), **kw):
    from nnscaler_plugins.search.space import config_of

    t0 = time.time()
    try:
        plans = nns.search(graph, world_size=world, cluster=spec, global_batch_size=batch, memory_limit=limit,
                           progress=False, constraints=list(constraints), **kw)
    except SearchError as e:
        return None, str(e)[:100], time.time() - t0, []
    knobs = [config_of(p, graph) for p in plans.plans]
    return plans.estimates[0], plans.best.options["summary"], time.time() - t0, knobs


def _fmt(e) -> str:
    return f"{e.step_time_s:.3g} s / {e.peak_memory_gib:.1f} GiB" if e is not None else "-"


def part_c(save: bool = True, quick: bool = False) -> None:
    from nnscaler_plugins.capture.experts import experts_as_one_op
    from nnscaler_plugins.search.constraints import MaxContextParallel, MaxExpertParallel

    rows = []
    limit = 80 * GiB
    world, batch = 64, 256
    model, inputs = mixtral_8x7b(layers=8 if quick else 32)
    with experts_as_one_op(model):
        g = nns.capture(model, kwargs=inputs)
    spec = nns.cluster("h100-dgx", nodes=world // 8)
    recipe_est = nns.simulate(ep_recipe(g, world, batch // (world // 8)), spec, cost_model=CostModel(g, spec))
    with_ep, plan_ep, s_ep, knobs = _best(g, world, spec, batch, limit)
    no_ep, _, s_no, _ = _best(g, world, spec, batch, limit, [MaxExpertParallel(1)])
    speed = lambda a, b: f"{a.step_time_s / b.step_time_s:.2f}x" if a is not None and b is not None else "-"  # noqa
    rows.append(("MoE (Mixtral-8x7B shape" + (", 8 layers" if quick else "") + "), seq 4096", f"{world}", f"{batch}",
                 _fmt(with_ep), _fmt(no_ep), speed(no_ep, with_ep), _fmt(recipe_est)
                 + ("" if recipe_est.max_memory_bytes <= limit else " (over)"), speed(recipe_est, with_ep),
                 plan_ep, f"{s_ep + s_no:.0f}"))
    print(" | ".join(rows[-1]), flush=True)
    cases = [(32768, 8), (131072, 8), (131072, 64)] if quick else [(32768, 8), (32768, 32), (131072, 32), (131072, 64)]
    for seq, world in cases:
        model, inputs = llama_8b(seq, layers=8 if quick else 32)
        g = nns.capture(model, kwargs=inputs)
        spec = nns.cluster("h100-dgx", nodes=max(1, world // 8))
        batch = 8
        with_cp, plan_cp, s_cp, knobs = _best(g, world, spec, batch, limit, context_parallel=True)
        no_cp, _, s_no, _ = _best(g, world, spec, batch, limit, [MaxContextParallel(1)], context_parallel=False)
        uses = sum(1 for k in knobs if k.cp > 1)
        rows.append((f"Llama-8B shape{', 8 layers' if quick else ''}, seq {seq // 1024}k", f"{world}", f"{batch}",
                     _fmt(with_cp), _fmt(no_cp), speed(no_cp, with_cp) if no_cp is not None else "none fits without cp",
                     "-", "-", f"{uses} of {len(knobs)} frontier plans use cp; fastest: {plan_cp}",
                     f"{s_cp + s_no:.0f}"))
        print(" | ".join(rows[-1]), flush=True)
    if save:
        record("plan_quality.py part C: expert and context parallelism in the search (simulated, H100 preset)", rows,
               ("model", "GPUs", "global batch (sequences)", "search with ep/cp (time / peak)",
                "best plan without ep/cp", "speed-up over it", "Megatron-style ep recipe", "speed-up over the recipe",
                "search's plan", "search wall s"), NOTES_C, keep_previous=True)


NOTES_C = """Memory limit 80 GiB per GPU for every plan. The MoE rows capture each layer's experts as one op
(`capture/experts.py`): the search may split them with their tokens (ep, dispatch and combine by
all-to-all priced on the link hierarchy by `search/group_kernels.py`) or keep them whole on each device;
"without ep" is the same search held to `MaxExpertParallel(1)`. The Megatron-style recipe is the `ep`
strategy with ep 8 and tp 8 over a node's GPUs (attention and the dense layers tensor-parallel, the
experts split by expert), data parallelism across nodes and ZeRO-1, simulated the same way. The
long-sequence rows search attention split along its sequence (cp degree and ring / allgather / Ulysses)
beside everything else; "without cp" holds the search to `MaxContextParallel(1)`. Expert routing is
priced as even (every expert gets its share of the rows); real routing is skewed, which costs ep plans
more than shown."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("A", "B", "C", "both", "all"), default="both")
    ap.add_argument("--quick", action="store_true", help="part A only up to 512 GPUs")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--clusters", default="a100-dgx,h100-dgx", help="part B's presets, comma-separated")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.part in ("B", "both", "all"):
        part_b(save=not args.no_record, clusters=tuple(args.clusters.split(",")))
    if args.part in ("A", "both", "all"):
        part_a(args.quick, save=not args.no_record)
    if args.part in ("C", "all"):
        part_c(save=not args.no_record, quick=args.quick)


if __name__ == "__main__":
    main()
