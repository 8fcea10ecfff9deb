"""One-GPU checks of large models, experts and context parallelism's kernels, against plain PyTorch.

    python benchmarks/gpu_wave.py                 # on a machine with one CUDA GPU: results to RESULTS.md
    python benchmarks/gpu_wave.py --small         # tiny shapes on whatever device is there (smoke test)
    python benchmarks/gpu_wave.py --sections ring # some of: meta, moe, ring

Three sections, each written to RESULTS.md:

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
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

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

    def eager_step() -> float:
        eager.zero_grad(set_to_none=False)
        loss = eager(**batch).loss
        loss.backward()
        return loss.item()

    def ours_step() -> float:
        for p in pm.parameters():
            p.grad = None
        return pm.train_step(batch).item()

    first_eager, first_ours = eager_step(), ours_step()
    grads = {n.replace(".", "__"): p.grad for n, p in eager.named_parameters()}
    worst, compared = 0.0, 0
    for n, p in pm.named_parameters():  # world 1: every shard is its whole parameter
        key = n.split(".", 1)[-1]
        if p.grad is not None and key in grads:
            ref = grads[key]
            worst = max(worst, float((p.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
            compared += 1
    if compared < len(grads):
        raise RuntimeError(f"compared {compared} of {len(grads)} gradients: the shards' names did not match")
    p = common.time_paired(eager_step, ours_step, warmup=1, iters=iters, sync=common.sync_device)
    name = f"mixtral {shape['num_hidden_layers']}x{shape['hidden_size']} 8 experts top-2"
    return [(name, f"{batch['input_ids'].numel()}", f"{abs(first_ours - first_eager) / abs(first_eager):.1e}",
             f"{worst:.1e}", f"{p.a * 1e3:.1f}", f"{p.b * 1e3:.1f}", *p.cells(2))]


# -- 3. ring attention's per-block kernel against whole attention -----------------------------------
def ring_blocks(device: torch.device, small: bool, iters: int) -> list[tuple[str, ...]]:
    from nnscaler_plugins.runtime.ring_attention import block_attention, merge_blocks

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on whatever device is there (smoke test)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sections", default="meta,moe,ring")
    ap.add_argument("--no-record", action="store_true", help="print only; leave RESULTS.md as it is")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    common.env_world_one()
    sections = args.sections.split(",")
    unknown = set(sections) - {"meta", "moe", "ring"}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose among meta, moe, ring")
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
    for title, rows, header in out:
        if args.no_record or args.small or device.type != "cuda":
            print(title)
            for row in rows:
                print("  ", dict(zip(header, row)))
        else:
            print(common.record(title, rows, header))


if __name__ == "__main__":
    main()
