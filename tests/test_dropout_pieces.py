"""Dropout on many devices: copies of a value draw the same mask, pieces of a split value and
data-parallel replicas draw independent masks, at the op's rate; and where every dropout of a
plan is a whole op on one replica (a pipeline's stages, tensor parallelism's replicated residual
stream) training in train() mode reproduces one process exactly.

Statistics: a dropout with p = 0.3 on a hidden activation tensor parallelism splits (64 x 256
elements, two pieces of 64 x 128) keeps 1 - p of the elements within 5 binomial standard
deviations; the two pieces' masks agree where independent masks would (p^2 + (1-p)^2 of the
elements, within 5 sigma), not everywhere (what every rank seeded alike used to draw); the copies
of a dropout on the replicated output are equal on both ranks even when the ranks' generators were
seeded differently (each rank drew its own mask for its copy before); two data-parallel replicas
given the same rows draw independent masks; and the next forward draws new ones.

Exactness: the reference is eager PyTorch on the whole batch, its `F.dropout` calls run under the
seed `kernels.piece_rng` gives piece 0 of the k-th random op of the forward (`KeyedDropout`).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import nnscaler_plugins.kernels.piece_rng as piece_rng

P_SPLIT, P_COPY = 0.3, 0.5
B, HIDDEN = 64, 256


class TwoDropouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, 16)
        self.split = torch.nn.Dropout(P_SPLIT)
        self.copy = torch.nn.Dropout(P_COPY)

    def forward(self, x):
        h = self.split(torch.relu(self.up(x)) + 1)  # split along its width under tp (column-parallel)
        z = self.copy(self.down(h).abs() + 1)  # the row-parallel output, whole on every device
        return h, z


def _masks(rank, world, strategy, same_rows, seed_per_rank):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model = TwoDropouts().train()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, 16, generator=g)
    if not same_rows and strategy == "dp":
        x = torch.randn(B * world, 16, generator=g)[rank * B:(rank + 1) * B]
    torch.manual_seed(100 + rank if seed_per_rank else 7)  # users seed ranks alike, or each its own
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, (x,), plan=strategy, cache_dir="/tmp/nns_test_cache")
    with torch.no_grad():
        h, z = pm(x)
        h2, _ = pm(x)
    return (h != 0), (z != 0), (h2 != 0), pm.plan.ops["dropout"].splits


def _within(value: float, expected: float, n: int, what: str) -> None:
    sigma = math.sqrt(expected * (1 - expected) / n)
    assert abs(value - expected) <= 5 * sigma, f"{what}: {value:.4f} vs {expected:.4f} (5 sigma = {5 * sigma:.4f})"


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


@pytest.mark.parametrize("seed_per_rank", [False, True], ids=["ranks-seeded-alike", "ranks-seeded-apart"])
def test_tensor_parallel_pieces_independent_copies_equal(workers2, seed_per_rank):
    (h0, z0, h0b, splits), (h1, z1, _, _) = workers2.run(_masks, "tp", True, seed_per_rank)
    assert splits, "the test needs tp to split the first dropout's input"
    assert torch.equal(h0, h1), "the gathered split value differs between ranks"
    keep = 1 - P_SPLIT
    _within(h0.float().mean().item(), keep, h0.numel(), "keep rate of the split dropout")
    left, right = h0[:, :HIDDEN // 2], h0[:, HIDDEN // 2:]
    _within(_agreement(left, right), keep ** 2 + P_SPLIT ** 2, left.numel(), "agreement of the two pieces' masks")
    assert torch.equal(z0, z1), "the copies of the replicated dropout drew different masks on the two ranks"
    _within(z0.float().mean().item(), 1 - P_COPY, z0.numel(), "keep rate of the replicated dropout")
    _within(_agreement(h0, h0b), keep ** 2 + P_SPLIT ** 2, h0.numel(), "agreement of two forwards' masks")


def test_data_parallel_replicas_draw_independent_masks(workers2):
    (h0, z0, _, _), (h1, z1, _, _) = workers2.run(_masks, "dp", True, False)  # the same rows on both replicas
    keep = 1 - P_SPLIT
    _within(h0.float().mean().item(), keep, h0.numel(), "keep rate on replica 0")
    _within(_agreement(h0, h1), keep ** 2 + P_SPLIT ** 2, h0.numel(), "agreement of the replicas' masks")
    _within(_agreement(z0, z1), 0.5, z0.numel(), "agreement of the replicas' second masks")


# -- exactness where the masks can be compared ---------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, h):
        return h + self.drop(self.down(torch.nn.functional.gelu(self.up(h))))  # Megatron's: after the row-parallel


class DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids, labels):
        h = self.drop(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        return {"loss": torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())}


class KeyedDropout(TorchFunctionMode):
    """Eager dropout drawing what a parallel plan's piece 0 on replica 0 draws: the k-th dropout of
    forward f under the seed of (base seed, f, replica 0, k, piece 0)."""

    def __init__(self, seed: int):
        super().__init__()
        self.seed, self.forward, self.calls = seed, -1, 0

    def next_forward(self) -> None:
        self.forward, self.calls = self.forward + 1, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            token = piece_rng.Token(self.seed, self.forward, 0)
            key, self.calls = self.calls, self.calls + 1
            with piece_rng.fork(token, key, 0, args[0].device):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _train_with_dropout(rank, world, strategy, options, steps=3):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    ref = DropoutNet()
    model = DropoutNet()
    model.load_state_dict(ref.state_dict())
    ref.train(), model.train()
    g = torch.Generator().manual_seed(1)
    batch = {"ids": torch.randint(0, 32, (8, 6), generator=g), "labels": torch.randint(0, 4, (8, 6), generator=g)}
    torch.manual_seed(11)  # the base seed every rank takes (rank 0's)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, batch, plan=strategy, cache_dir="/tmp/nns_test_cache", **options)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    keyed = KeyedDropout(11)
    problems = []
    m = pm.plan.num_micro_batches
    for step in range(steps):
        loss = pm.train_step(batch).detach().float()
        ref_loss = 0.0
        for i in range(m):  # gradient accumulation over the same micro-batches, one forward each
            micro = {k: v.chunk(m)[i] for k, v in batch.items()}
            keyed.next_forward()
            with keyed:
                part = ref(**micro)["loss"] / m
            part.backward()
            ref_loss = ref_loss + part.detach()
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
            problems.append(f"{strategy} step {step}: loss {loss.item():.7g} vs one process {ref_loss.item():.7g}")
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        full = pm.full_state_dict()
        for k, t in ref.state_dict().items():
            if not torch.allclose(full[k].float(), t.float(), rtol=1e-5, atol=1e-6):
                problems.append(f"{strategy} step {step}: {k} differs from one process's")
    return problems


@pytest.mark.parametrize("strategy,options", [("tp", {}), ("gpipe", {"pp": 2, "micro_batches": 1}),
                                              ("1f1b", {"pp": 2, "micro_batches": 2}), ("tp", {"recompute": "full"})],
                         ids=["tp", "gpipe", "1f1b-2-micro-batches", "tp-recompute"])
def test_train_mode_with_dropout_equals_one_process(workers2, strategy, options):
    problems = workers2.run(_train_with_dropout, strategy, options)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)
