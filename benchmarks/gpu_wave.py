"""One-GPU checks of large models, experts and context parallelism's kernels, against plain PyTorch.

    python benchmarks/gpu_wave.py                 # on a machine with one CUDA GPU: results to RESULTS.md
    python benchmarks/gpu_wave.py --small         # tiny shapes on whatever device is there (smoke test)
    python benchmarks/gpu_wave.py --sections ring # some of: meta, moe, ring, speed, collectives, flex

Six sections, each written to RESULTS.md:

1. meta: a Llama-2-7B-shaped model built under `torch.device("meta")`, parallelized with plan
   "zero3", `precision="bf16"` and `offload="optimizer"` on one GPU (NCCL, world 1): the weights
   are made on the GPU by the model's own initialization, AdamW's state and step live on the host.
   One training step; its peak GPU memory next to plain PyTorch's (the bf16 model and a fused
   AdamW on the GPU), or "OOM" where plain PyTorch does not fit.
2. moe: a Mixtral-shaped model, training steps through the generated code (plan "ep" at world 1:
   each experts layer one op) against the same model eager, same weights and batch: first-step
   loss and largest gradient difference, and the ratio of the median step times (steps alternate; the median per-step ratio beside it).
3. ring: the kernel a ring-attention step runs per block (`runtime.ring_attention.block_attention`:
   on CUDA torch's memory-efficient SDPA, which returns the log-sum-exp) on two key blocks merged by
   their log-sum-exps (`merge_blocks`), against `scaled_dot_product_attention` on the whole
   sequence, causal and not: largest difference, and the time ratio.
4. speed: a Llama-3-8B-shaped model (as many layers as fit the GPU, sequence 4096 by default, bf16)
   trained through the generated code eagerly, with compile=True, and with compile=True and
   precision="fp8", each beside plain PyTorch doing the same (regional torch.compile, torchao's
   float8) on the same GPU in the same run: tokens/s, their ratio, and MFU by torchtitan's FLOP count
   against the bf16 dense peak (fp8 rows too, for comparison). Budget: about 4 minutes on an H100,
   most of it compilation (the warm-up column).
5. collectives: every collective the generated code calls, forward and backward over the world-1
   NCCL group, against the same call without communication; the median time of each.
6. flex: a small Llama-style model whose attention is FlexAttention with a causal block mask and
   a score_mod reading the head index, trained through the generated code (plan "tp" at world 1:
   the FlexAttention op and its kernel) against the same model eager: first-step loss, largest
   gradient difference, time ratio. A second row passes a document mask made from the batch's
   end-of-sequence tokens to forward (torchtitan's way; the op builds it from the batch's tensors
   each step). FlexAttention has no backward on a CPU, so `--small` on a CPU compares the
   forward's loss only (the rows say so).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402


def _tokens(batch: int, seq: int, vocab: int, device: torch.device) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return {"input_ids": ids, "labels": ids}


# -- 1. a 7B model made on meta, ZeRO-3 with the optimizer on the host ------------------------------
def meta_offload(device: torch.device, small: bool) -> list[tuple[str, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=1000) if small else \
        dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000)
    cfg = LlamaConfig(**shape, max_position_embeddings=4096)
    batch = _tokens(1, 64 if small else 512, cfg.vocab_size, device)

    common.reset_peak()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    pm = nns.parallelize(model, batch, plan="zero3", precision="bf16", offload="optimizer",
                         cache_dir="/tmp/nns_bench_cache")
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-5)
    common.sync_device()
    start = time.perf_counter()
    loss = pm.train_step(batch).item()
    opt.step()
    common.sync_device()
    ours_s, ours_gib = time.perf_counter() - start, common.peak_gib()
    del pm, opt, model
    common.reset_peak()

    plain_s, plain_gib = float("nan"), "OOM"
    try:
        plain = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
        popt = torch.optim.AdamW(plain.parameters(), lr=1e-5, fused=device.type == "cuda")
        common.reset_peak()
        common.sync_device()
        start = time.perf_counter()
        plain(**batch).loss.backward()
        popt.step()
        common.sync_device()
        plain_s, plain_gib = time.perf_counter() - start, f"{common.peak_gib():.1f}"
        del plain, popt
    except torch.OutOfMemoryError:
        pass
    common.reset_peak()
    name = f"llama {shape['num_hidden_layers']}x{shape['hidden_size']} ({params / 1e9:.2f}B)" if params > 1e9 else \
        f"llama {shape['num_hidden_layers']}x{shape['hidden_size']} ({params / 1e6:.1f}M)"
    return [(name, f"{batch['input_ids'].numel()}", f"{ours_gib:.1f}", plain_gib, f"{ours_s:.2f}",
             f"{plain_s:.2f}", f"{loss:.3f}")]


# -- 2. a MoE model through the generated code against eager ----------------------------------------
def moe_generated_vs_eager(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    from transformers import MixtralConfig, MixtralForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512) if small else \
        dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000)
    cfg = MixtralConfig(**shape, num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
                        router_aux_loss_coef=0.01, max_position_embeddings=2048)
    torch.manual_seed(0)
    eager = MixtralForCausalLM(cfg).to(device)
    mine = copy.deepcopy(eager)
    batch = _tokens(2 if small else 4, 32 if small else 512, cfg.vocab_size, device)
    pm = nns.parallelize(mine, batch, plan="ep", cache_dir="/tmp/nns_bench_cache")

    p, first, worst = train_against_eager(eager, pm, batch, lambda out: out.loss, iters)
    name = f"mixtral {shape['num_hidden_layers']}x{shape['hidden_size']} 8 experts top-2"
    return [(name, f"{batch['input_ids'].numel()}", f"{first:.1e}", f"{worst:.1e}", f"{p.a * 1e3:.1f}",
             f"{p.b * 1e3:.1f}", *p.cells(2))]


def train_against_eager(eager: torch.nn.Module, pm: Any, batch: dict, loss_of: Callable[[Any], torch.Tensor],
                        iters: int) -> tuple[common.Paired, float, float]:
    """One world-1 training step of `eager` and of its generated copy `pm` on `batch`, then their
    steps timed in alternation: (the paired times, the first losses' relative difference, the
    worst relative gradient difference over every parameter; every parameter must be compared)."""

    def eager_step() -> float:
        eager.zero_grad(set_to_none=False)
        loss = loss_of(eager(**batch))
        loss.backward()
        return loss.item()

    def ours_step() -> float:
        for q in pm.parameters():
            q.grad = None
        return pm.train_step(batch).item()

    first_eager, first_ours = eager_step(), ours_step()
    grads = {n: q.grad for n, q in eager.named_parameters()}
    worst, compared = 0.0, 0
    for n, q in pm.named_parameters():  # world 1: every shard is its whole parameter
        ref = grads.get(n.split(".", 1)[-1].replace("__", "."))
        if q.grad is not None and ref is not None:
            worst = max(worst, float((q.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
            compared += 1
    if compared < len(grads):
        raise RuntimeError(f"compared {compared} of {len(grads)} gradients: the shards' names did not match")
    p = common.time_paired(eager_step, ours_step, warmup=1, iters=iters, sync=common.sync_device)
    return p, abs(first_ours - first_eager) / abs(first_eager), worst


# -- 3. ring attention's per-block kernel against whole attention -----------------------------------
def ring_blocks(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    from nnscaler_plugins.kernels.ring_attention import block_attention, merge_blocks

    rows = []
    dtypes = (torch.float32,) if device.type != "cuda" else (torch.bfloat16, torch.float16)
    b, h, s, d = (2, 4, 64, 16) if small else (1, 32, 8192, 128)
    for dtype in dtypes:
        for causal in (True, False):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype) for _ in range(3))
            scale = 1.0 / math.sqrt(d)
            half = s // 2

            def whole() -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

            def ring() -> torch.Tensor:
                outs = []
                for a in range(2):
                    out = lse = None
                    qa = q[..., a * half:(a + 1) * half, :]
                    for kb in range(2):
                        if causal and kb > a:
                            continue  # nothing visible
                        mask = torch.ones(half, half, dtype=torch.bool, device=device).tril() \
                            if causal and kb == a else None
                        o, l = block_attention(qa, k[..., kb * half:(kb + 1) * half, :].contiguous(),
                                               v[..., kb * half:(kb + 1) * half, :].contiguous(), mask, scale)
                        out, lse = merge_blocks(out, lse, o, l)
                    outs.append(out)
                return torch.cat(outs, -2)

            want, got = whole().float(), ring().float()
            err = float((got - want).abs().max() / want.abs().max())
            p = common.time_paired(whole, ring, warmup=1, iters=iters, sync=common.sync_device)
            rows.append((f"{b}x{h}x{s}x{d}", str(dtype).replace("torch.", ""), "causal" if causal else "full",
                         f"{err:.1e}", f"{p.a * 1e3:.2f}", f"{p.b * 1e3:.2f}", *p.cells(2)))
    return rows


# -- 4. speed: eager, compile, compile + fp8 on a Llama-3-8B-shaped model, against plain PyTorch ----------
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
SPEED_MODES = ("eager", "compile", "compile + fp8")


def layer_params(shape: dict) -> int:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def flops_per_token(shape: dict, layers: int, seq: int) -> float:
    """torchtitan's count: 6 x the parameters without the input embedding (the output layer counted)
    + 12 x layers x heads x head dim x sequence (attention's two products, forward and backward)."""
    h, v, heads = shape["hidden_size"], shape["vocab_size"], shape["num_attention_heads"]
    params = layers * layer_params(shape) + h + v * h
    return 6.0 * params + 12.0 * layers * heads * (h // heads) * seq


def layers_that_fit(shape: dict, seq: int) -> int:
    """As many layers as one model's training state fits in 80 % of the free GPU memory, counted as
    16 bytes per parameter (bf16 weights and gradients, fp32 master weights and Adam's two moments;
    plain PyTorch's fp32 weights, gradients and moments are 16 too) plus each layer's activations
    without recomputation (about seq x (34 h + 10 i) bytes in bf16) and the logits' fp32 copies."""
    free, _ = torch.cuda.mem_get_info()
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    fixed = 2 * v * h * 16 + seq * v * 12
    per_layer = layer_params(shape) * 16 + seq * (34 * h + 10 * i)
    return max(1, min(32, int((0.8 * free - fixed) // per_layer)))


def peak_bf16_flops(device: torch.device) -> float:
    """The device's dense bf16 peak from the cluster presets (nan for devices they do not describe)."""
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    preset = "h200" if "H200" in name else "h100-dgx" if "H100" in name else "a100-dgx" if "A100" in name else None
    return nns.cluster(preset).peak_flops["bf16"] if preset else float("nan")


def _median_step(step, warmup: int, iters: int) -> tuple[float, float]:
    """(seconds of the warm-up steps, compilation included; median seconds of the timed steps)."""
    common.sync_device()
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    common.sync_device()
    first = time.perf_counter() - start
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        common.sync_device()
        times.append(time.perf_counter() - t)
    times.sort()
    return first, times[len(times) // 2]


def speed(device: torch.device, small: bool, iters: int, seq: int, layers: int = 0) -> list[tuple[str, ...]]:
    """Tokens/s and MFU of training steps (forward, backward, AdamW) through the generated code
    (plan dp, world 1) against plain PyTorch doing the same on the same GPU, one after the other:
    eager (ours bf16; plain fp32 weights under bf16 autocast, fused AdamW), compile (ours
    compile=True; plain torch.compile of each decoder layer, torchtitan's regional compile) and
    compile + fp8 (ours precision="fp8"; plain torchao's convert_to_float8_training, tensorwise).
    On the CPU (--small) the compilers run with aot_eager and the float8 products are emulated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if small else LLAMA3_8B
    seq = 32 if small else seq
    n = 2 if small else (layers or layers_that_fit(shape, seq))
    cfg = LlamaConfig(**shape, num_hidden_layers=n, max_position_embeddings=max(seq, 64), use_cache=False,
                      attn_implementation="sdpa")
    batch = _tokens(1, seq, cfg.vocab_size, device)
    tokens = batch["input_ids"].numel()
    fpt = flops_per_token(shape, n, seq)
    peak = peak_bf16_flops(device)
    backend = "aot_eager" if device.type != "cuda" else "inductor"
    emulate = device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    warmup, iters = (1, 2) if small else (3, iters)
    rows = []
    for mode in SPEED_MODES:
        compiled, fp8 = mode != "eager", mode.endswith("fp8")

        def ours() -> tuple[float, float]:
            torch.manual_seed(0)
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
            options = dict(precision="fp8" if fp8 else "bf16", compile=compiled, compile_backend=backend)
            if fp8:
                options["fp8_emulate"] = emulate
            pm = nns.parallelize(model, batch, plan="dp", cache_dir="/tmp/nns_bench_cache", **options)
            del model
            opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-5)

            def step() -> None:
                pm.train_step(batch)
                opt.step()
                opt.zero_grad()
            try:
                return _median_step(step, warmup, iters)
            finally:
                del pm, opt
                common.reset_peak()

        def plain() -> tuple[float, float]:
            torch.manual_seed(0)
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
            if fp8:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate))
            if compiled:
                for layer in model.model.layers:
                    layer.compile(backend=backend)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

            def step() -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            try:
                return _median_step(step, warmup, iters)
            finally:
                del model, opt
                common.reset_peak()

        results = []
        for run in (ours, plain):
            try:
                results.append(run())
            except torch.OutOfMemoryError:
                common.reset_peak()
                results.append((float("nan"), float("nan")))
        (o_first, o_step), (p_first, p_step) = results
        o_tps, p_tps = tokens / o_step, tokens / p_step
        rows.append((mode, f"{n} x {shape['hidden_size']}", str(seq), f"{o_tps:,.0f}", f"{p_tps:,.0f}",
                     f"{o_tps / p_tps:.2f}", f"{100 * o_tps * fpt / peak:.1f}", f"{100 * p_tps * fpt / peak:.1f}",
                     f"{o_first:.0f}", f"{p_first:.0f}"))
    return rows


# -- 5. every collective the generated code calls, over NCCL at world 1 ---------------------------------
def collective_paths(device: torch.device, iters: int) -> list[tuple[str, ...]]:
    """Each collective of kernels/collectives.py and each group-aware kernel the generated code can
    call, run forward and backward over the one-process world group (NCCL on a GPU: the library's
    real calls, with one rank) against the same function without a group (no communication): the
    values and gradients must agree. Paths that shortcut at one rank (ring attention's sends to the
    next device, the batch statistics across replicas) need two devices and are not here."""
    import torch.distributed as dist

    from nnscaler_plugins.kernels import collectives as C
    from nnscaler_plugins.kernels.expert_dispatch import all_to_all_rows, exchange_counts
    from nnscaler_plugins.kernels.piece_functions import vocab_parallel_cross_entropy
    from nnscaler_plugins.kernels.ring_attention import ulysses_attention

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    world = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 16, generator=g).to(device)
    labels = torch.randint(0, 16, (8,), generator=g).to(device)
    qkv0 = [torch.randn(1, 4, 16, 8, generator=g).to(device) for _ in range(3)]
    paths = {
        "all-gather": lambda x, grp: C.all_gather(x, 0, grp),
        "reduce-scatter": lambda x, grp: C.reduce_scatter(x, 0, grp),
        "all-reduce": lambda x, grp: C.all_reduce(x, grp),
        "chunk (all-gather in backward)": lambda x, grp: C.chunk(x, 1, grp),
        "all-to-all": lambda x, grp: C.all_to_all(x, 0, 1, grp),
        "grad sum (all-reduce in backward)": lambda x, grp: C.identity_fwd_allreduce_bwd(x, grp),
        "all-gather, reduce-scatter in backward": lambda x, grp: C.allgather_fwd_reducescatter_bwd(x, 0, grp),
        "vocab-parallel cross-entropy": lambda x, grp: vocab_parallel_cross_entropy(x, labels, 0, group=grp),
        "expert rows all-to-all": lambda x, grp: x if grp is None else all_to_all_rows(x, [x.shape[0]],
                                                                                      [x.shape[0]], grp),
        "expert counts all-gather": lambda x, grp: x * (1 if grp is None else exchange_counts(
            torch.tensor([3, 5], device=x.device), 0, grp)[0, 1:].sum() / 8),
        "ulysses attention (all-to-alls)": lambda x, grp: x.sum() * ulysses_attention(
            *qkv0, is_causal=True, group=grp).sum() if grp is not None else x.sum() * torch.nn.functional.
        scaled_dot_product_attention(*qkv0, is_causal=True).sum(),
    }
    rows = []
    for name, fn in paths.items():
        outs = []
        for grp in (None, world):
            x = x0.clone().requires_grad_(True)
            out = fn(x, grp)
            out.float().sum().backward()
            outs.append((out.detach().float(), x.grad.float()))
        (want, want_g), (got, got_g) = outs
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.allclose(got_g, want_g, rtol=1e-5, atol=1e-6)
        times = []
        for _ in range(iters):
            x = x0.clone().requires_grad_(True)
            common.sync_device()
            t = time.perf_counter()
            fn(x, world).float().sum().backward()
            common.sync_device()
            times.append(time.perf_counter() - t)
        times.sort()
        rows.append((name, "agrees" if ok else "DIFFERS", f"{times[len(times) // 2] * 1e3:.3f}"))
    return rows


# -- 6. FlexAttention through the generated code ------------------------------------------------------
class _FlexBlock(torch.nn.Module):
    """Pre-norm attention (FlexAttention, causal block mask, a per-head bias as score_mod) and an MLP."""

    def __init__(self, d: int, heads: int, mask):
        super().__init__()
        self.heads, self.mask = heads, mask
        self.norm1, self.norm2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.up, self.down = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)

    @staticmethod
    def head_bias(score, b, h, q, kv):
        return score - 0.05 * (h + 1) * (q - kv).abs()

    def forward(self, x, mask=None):
        from torch.nn.attention.flex_attention import flex_attention

        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = flex_attention(q, k, v, score_mod=self.head_bias, block_mask=self.mask if mask is None else mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))


class _FlexLM(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, mask):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab, bias=False)
        self.blocks = torch.nn.ModuleList([_FlexBlock(d, heads, mask) for _ in range(layers)])

    def forward(self, input_ids, labels, attention_masks=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, attention_masks)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _document_mask(ids: torch.Tensor, eos: int):
    """torchtitan's document mask (causal within each document), made from the batch outside the model."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    ends = ids == eos
    ends[:, -1] = True
    cumulative = torch.cumsum(torch.where(ends, 1, 0), dim=1)
    docs = torch.zeros_like(cumulative, dtype=torch.int32)
    docs[:, 1:] = cumulative[:, :-1]

    def document(b, h, q, kv):
        return docs[b, q] == docs[b, kv]

    return create_block_mask(and_masks(lambda b, h, q, kv: q >= kv, document), ids.shape[0], None, ids.shape[1],
                             ids.shape[1], device=str(ids.device))


def flex_training(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    from torch.nn.attention.flex_attention import create_block_mask

    b, s, d, heads, layers, vocab = (2, 128, 64, 4, 2, 512) if small else (4, 2048, 1024, 16, 4, 32000)
    mask = create_block_mask(lambda b_, h_, q, kv: q >= kv, None, None, s, s, device=str(device))
    rows = []
    for what in ("causal + head bias", "document mask passed to forward + head bias"):
        torch.manual_seed(0)
        eager = _FlexLM(vocab, d, heads, layers, mask).to(device)
        mine = copy.deepcopy(eager)
        batch = _tokens(b, s, vocab, device)
        if what.startswith("document"):
            batch["attention_masks"] = _document_mask(batch["input_ids"], eos=7)
        pm = nns.parallelize(mine, batch, plan="tp", cache_dir="/tmp/nns_bench_cache")
        name = f"flex llama {layers}x{d}, {heads} heads, {what}"
        if device.type != "cuda":  # no FlexAttention backward on a CPU: the forward only
            with torch.no_grad():
                want, got = eager(**batch).item(), float(pm(**batch))
            rows.append((name, f"{b * s}", f"{abs(got - want) / abs(want):.1e}", "forward only (no CPU backward)",
                         "-", "-", "-", "-"))
            continue
        p, first, worst = train_against_eager(eager, pm, batch, lambda out: out, iters)
        rows.append((name, f"{b * s}", f"{first:.1e}", f"{worst:.1e}", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}",
                     *p.cells(2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on whatever device is there (smoke test)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--seq", type=int, default=4096, help="the speed section's sequence length (4096 or 8192)")
    ap.add_argument("--layers", type=int, default=0, help="the speed section's layers (default: as many as fit)")
    ap.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md as it is")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    common.env_world_one()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose among {', '.join(SECTIONS)}")
    out = []
    if "meta" in sections:
        out.append(("gpu_wave.py: 7B-shaped Llama made on meta, zero3 + bf16 + optimizer offload, one GPU, vs plain "
                    "PyTorch", meta_offload(device, args.small),
                    ("model", "tokens", "ours peak GiB", "plain peak GiB (bf16 + fused AdamW)", "ours step s",
                     "plain step s", "our first loss")))
    if "moe" in sections:
        out.append(("gpu_wave.py: MoE training step on one GPU, generated code (plan ep) vs eager",
                    moe_generated_vs_eager(device, args.small, args.iters),
                    ("model", "tokens", "first loss rel diff", "largest grad diff (rel. to grad max)", "eager ms",
                     "ours ms", "ratio eager/ours of the median steps", "median per-step ratio")))
    if "ring" in sections:
        out.append(("gpu_wave.py: ring attention's per-block kernel (two blocks merged by log-sum-exp) vs whole SDPA",
                    ring_blocks(device, args.small, args.iters),
                    ("shape b x h x s x d", "dtype", "mask", "max diff (rel. to max)", "sdpa ms", "ring blocks ms",
                     "ratio sdpa/ring of the median times", "median per-step ratio")))
    if "speed" in sections:
        start = time.perf_counter()
        rows = speed(device, args.small, args.iters, args.seq, args.layers)
        out.append(("gpu_wave.py: Llama-3-8B-shaped training steps on one GPU, generated code vs plain PyTorch "
                    "(eager, compile, compile + fp8)", rows,
                    ("mode", "layers x hidden", "sequence", "ours tokens/s", "plain tokens/s", "ratio ours/plain",
                     "ours MFU % (bf16 peak)", "plain MFU % (bf16 peak)", "ours warm-up s", "plain warm-up s")))
        print(f"speed section: {time.perf_counter() - start:.0f} s")
    if "collectives" in sections:
        out.append(("gpu_wave.py: every collective of the generated code over the world-1 process group "
                    "(NCCL on a GPU) against no communication", collective_paths(device, args.iters),
                    ("path", "values and gradients", "median ms (forward + backward)")))
    if "flex" in sections:
        out.append(("gpu_wave.py: FlexAttention (causal and document block masks, score_mod) training through the generated code vs "
                    "eager, one GPU", flex_training(device, args.small, args.iters),
                    ("model", "tokens", "first loss rel diff", "largest grad diff (rel. to grad max)", "eager ms",
                     "ours ms", "ratio eager/ours of the median steps", "median per-step ratio")))
    for title, rows, header in out:
        if args.no_record or args.small or device.type != "cuda":
            print(title)
            for row in rows:
                print("  ", dict(zip(header, row)))
        else:
            print(common.record(title, rows, header))


SECTIONS = ("meta", "moe", "ring", "speed", "collectives", "flex")

if __name__ == "__main__":
    main()
