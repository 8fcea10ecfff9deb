"""`ep` (experts split, tokens by all-to-all) vs replicated experts (`dp`), gloo processes, same data.

    python benchmarks/expert_parallel.py            # 2 and 4 processes, 8 and 16 experts
    python benchmarks/expert_parallel.py --etp      # 4 processes: ep 4 against ep 2 x etp 2

A small Mixtral (2 layers, hidden 128, expert FFN 256, top-2, router loss on). Both plans train on
the same global batch: `dp` gives each rank `b` sequences and keeps every expert on every rank;
`ep` (ep = processes) gives the unit the whole global batch, each rank computing its `b`
sequences and its experts / ep experts. Each rank times full training steps (forward, backward,
gradient reduction, Adam step) of both, alternating step by step; the ratio is dp's median step
time / ep's, with the median per-step ratio beside it. Memory per rank is what the rank holds of the training state (parameters,
gradients, Adam moments; exact bytes) and its peak resident set (the process, both plans loaded).
"""
from __future__ import annotations

import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

HIDDEN, FFN, LAYERS, SEQ, PER_RANK = 128, 256, 2, 64, 4


def mixtral(experts: int, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts,
                        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                        max_position_embeddings=SEQ)
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg)


def state_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(all training state held here, of which expert state) in bytes after a step."""
    total = experts = 0
    for name, p in module.named_parameters():
        b = p.numel() * p.element_size() * (2 if p.grad is not None else 1)
        b += sum(t.numel() * t.element_size() for t in opt.state.get(p, {}).values()
                 if torch.is_tensor(t) and t.ndim > 0)
        total += b
        experts += b if "experts" in name else 0
    return total, experts


def paired(experts: int, a: tuple[dict, dict], b: tuple[dict, dict]):
    """Two plans of the same model, each (the batch this rank feeds it, parallelize options), trained
    with Adam in alternating steps: (`common.Paired` of a and b, state of a, state of b)."""
    import torch.distributed as dist

    import nnscaler_plugins as nns

    runs = []
    for batch, options in (a, b):
        pm = nns.parallelize(mixtral(experts), batch, cache_dir="/tmp/nns_bench_cache", **options)
        opt = nns.build_optimizer(pm, torch.optim.Adam, lr=1e-4)

        def step(pm=pm, opt=opt, batch=batch):
            pm.train_step(batch)
            opt.step()
            opt.zero_grad(set_to_none=False)

        runs.append((pm, opt, step))
    (pa, oa, sa), (pb, ob, sb) = runs
    return common.time_paired(sa, sb, warmup=1, iters=6, sync=dist.barrier), state_bytes(pa, oa), state_bytes(pb, ob)


def bench(rank: int, world: int, experts: int):
    """Replicated experts (dp, this rank's sequences) against ep over the world (the global batch)."""
    glob = common.batch(PER_RANK * world, SEQ, seed=7)
    mine = {k: v[rank * PER_RANK:(rank + 1) * PER_RANK] for k, v in glob.items()}
    out = paired(experts, (mine, {"plan": "dp"}), (glob, {"plan": "ep", "ep": world}))
    return out + (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,)


def bench_etp(rank: int, world: int, experts: int):
    """Same unit of `world` devices and global batch: experts split `world` ways (ep) against
    split world / 2 ways with each expert's width cut in 2 (ep x etp 2)."""
    glob = common.batch(PER_RANK * world, SEQ, seed=7)
    return paired(experts, (glob, {"plan": "ep", "ep": world}), (glob, {"plan": "ep", "ep": world // 2, "etp": 2}))


def main_etp() -> None:
    rows = []
    world = 4
    for experts in (8, 16):
        p, (ep_all, ep_exp), (et_all, et_exp) = common.spawn(bench_etp, world, experts)
        mib = 1 / 2**20
        rows.append((f"{world}", f"{experts}", f"{p.a * 1e3:.0f}", f"{p.b * 1e3:.0f}", *p.cells(2),
                     f"{ep_all * mib:.1f} ({ep_exp * mib:.1f})", f"{et_all * mib:.1f} ({et_exp * mib:.1f})"))
        print(rows[-1], flush=True)
    print(common.record(
        "expert_parallel.py --etp: experts split 4 ways (`ep=4`) vs 2 ways with each expert's width split 2 ways "
        "(`ep=2, etp=2`), Mixtral 2x128, top-2, 4 gloo processes (train step)",
        rows, ("processes", "experts", "ep 4 ms", "ep 2 x etp 2 ms", "ratio ep/etp of the median steps",
               "median per-step ratio",
               "ep 4 state MiB/rank (experts)", "ep 2 x etp 2 state MiB/rank (experts)"),
        notes="Same unit and global batch (4 sequences of 64 tokens per rank). Both hold a quarter of the "
              "experts' state per rank; etp adds a gather of each layer's tokens over the pair and a "
              "reduce-scatter of the partial outputs, and each rank dispatches its pair's tokens to 2 ranks "
              "instead of its own to 4."))


def main() -> None:
    if "--etp" in sys.argv[1:]:
        main_etp()
        return
    rows = []
    for world in (2, 4):
        for experts in (8, 16):
            p, (dp_all, dp_exp), (ep_all, ep_exp), rss = common.spawn(bench, world, experts)
            mib = 1 / 2**20
            rows.append((f"{world}", f"{experts}", f"{p.a * 1e3:.0f}", f"{p.b * 1e3:.0f}", *p.cells(2),
                         f"{dp_all * mib:.1f} ({dp_exp * mib:.1f})", f"{ep_all * mib:.1f} ({ep_exp * mib:.1f})",
                         f"{ep_exp / dp_exp:.3f}", f"{rss * mib:.0f}"))
            print(rows[-1], flush=True)
    print(common.record(
        "expert_parallel.py: `ep` vs replicated experts (`dp`), Mixtral 2x128, top-2, gloo processes (train step)",
        rows, ("processes", "experts", "dp ms", "ep ms", "ratio dp/ep of the median steps",
               "median per-step ratio",
               "dp state MiB/rank (experts)", "ep state MiB/rank (experts)", "expert state ep/dp",
               "peak RSS MiB (rank 0, both plans)"),
        notes="Same global batch for both (4 sequences of 64 tokens per rank). State = parameters + gradients + "
              "Adam moments held by the rank. On a CPU with gloo the all-to-alls go through loopback TCP; the "
              "expert matmuls are small, so the step time says how much the exchange costs here, not on GPUs."))


if __name__ == "__main__":
    main()
