"""`1f1b` plan vs torch.distributed.pipelining's Schedule1F1B: same model, stages and micro-batches.

    python benchmarks/pipeline_vs_torch.py

A GPT-style model (token embedding, pre-norm transformer blocks, LM head, cross-entropy) in plain
PyTorch, cut in the middle of its blocks into two stages on 2 gloo processes. PyTorch's side gets
the two halves as hand-made stage modules and its Schedule1F1B; ours captures the whole model and
runs the `1f1b` strategy, which cuts the same blocks. Both take the same batch in the same number
of micro-batches and run alternately, step by step, in the same processes. Ratio = PyTorch's median step
time / ours (higher is better for us), with the median per-step ratio beside it. The first losses must agree.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 256, heads: int = 8, layers: int = 4, seq: int = 128):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class FirstHalf(torch.nn.Module):
    def __init__(self, model: GPT, cut: int):
        super().__init__()
        self.tok, self.pos, self.blocks = model.tok, model.pos, model.blocks[:cut]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return x


class SecondHalf(torch.nn.Module):
    def __init__(self, model: GPT, cut: int):
        super().__init__()
        self.blocks, self.ln, self.head = model.blocks[cut:], model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def bench(rank: int, world: int, batch: int, seq: int, micro_batches: int, layers: int):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import nnscaler_plugins as nns

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (batch, seq), generator=g)
    inputs = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    theirs = GPT(layers=layers, seq=seq)
    torch.manual_seed(0)
    ours = GPT(layers=layers, seq=seq)
    cut = layers // 2
    half = FirstHalf(theirs, cut) if rank == 0 else SecondHalf(theirs, cut)
    mb = batch // micro_batches
    example = ids[:mb] if rank == 0 else torch.zeros(mb, seq, 256)
    stage = PipelineStage(half, rank, world, torch.device("cpu"), input_args=(example,))
    schedule = Schedule1F1B(stage, micro_batches,
                            loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    pm = nns.parallelize(ours, inputs, plan="1f1b", pp=world, micro_batches=micro_batches,
                         cache_dir="/tmp/nns_bench_cache")
    opt_t = torch.optim.SGD(half.parameters(), lr=1e-3)
    opt_o = torch.optim.SGD(pm.parameters(), lr=1e-3)
    first = {}

    def torch_step():
        losses: list = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=losses)
            first.setdefault("torch", torch.stack(losses).mean().item())
        opt_t.step()
        opt_t.zero_grad()

    def our_step():
        loss = pm.train_step(inputs)
        first.setdefault("ours", loss.item())
        opt_o.step()
        opt_o.zero_grad()

    return common.time_paired(torch_step, our_step, warmup=2, iters=16, sync=dist.barrier), first.get("torch"), \
        first.get("ours")


def main() -> None:
    world, batch, seq, m, layers = 2, 8, 128, 4, 4
    p, l_t, l_o = common.spawn_last(bench, world, batch, seq, m, layers)
    rows = [(f"GPT {layers}x256, 2 stages", f"{batch}x{seq}, {m} micro-batches", f"{p.a * 1e3:.1f}",
             f"{p.b * 1e3:.1f}", *p.cells(), f"{l_t:.5f} / {l_o:.5f}")]
    print(rows[-1], flush=True)
    print(common.record("pipeline_vs_torch.py: `1f1b` vs torch.distributed.pipelining Schedule1F1B, 2 gloo "
                        "processes (train step)", rows,
                        ("model", "batch", "PyTorch ms", "ours ms", "ratio PyTorch/ours of the median steps",
                         "median per-step ratio",
                         "first loss PyTorch / ours")))


if __name__ == "__main__":
    main()
