"""Batch norm in training is exact under every data-parallel plan: what one process computes on the
whole global batch, loss, gradients and running statistics.

Each replica used to normalize with its own shard's mean and variance and update its running
statistics from them (DDP without SyncBatchNorm): another model than one process trains. By default
(`batch_statistics="global"`) the lowering replaces every batch norm in training with a kernel that
combines the replicas' moments (SyncBatchNorm's arithmetic, `kernels.batch_norm_statistics`);
"local" keeps DDP's per-replica behaviour. Checked here in train() mode, SGD, fp32, relative 1e-5,
three steps, every parameter and buffer (running mean, variance and batch count) against one
process: dp, zero1-3, hybrid (tp x dp), tp (the op runs whole inside the unit), auto, a pipeline
without micro-batches; micro-batches are refused by name unless "local"; "local" equals DDP.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from sgd_check import replica_batch

N = 8  # the global batch


class Block(torch.nn.Module):
    def __init__(self, c: int, momentum: float):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c, momentum=momentum)

    def forward(self, h):
        return torch.relu(h + self.bn(self.conv(h)))


class ResBlockNet(torch.nn.Module):
    """A stem convolution and batch norm, two residual blocks each with its batch norm (layers a
    pipeline can cut), a 1-d batch norm on pooled features, a classifier: the batch is followed
    through one batch norm into the next."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.blocks = torch.nn.ModuleList([Block(8, 0.3), Block(8, 0.3)])
        self.fc = torch.nn.Linear(8, 16)
        self.bn3 = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, labels):
        h = torch.relu(self.bn1(self.conv1(x)))
        for block in self.blocks:
            h = block(h)
        h = torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        logits = self.head(torch.relu(self.bn3(self.fc(h))))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels)}


def build():
    model = ResBlockNet()
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(N, 3, 6, 6, generator=g) * 2 + 0.5, "labels": torch.randint(0, 4, (N,), generator=g)}
    return model, batch


def _train_like_one_process(rank, world, strategy, options, dp, steps=3):
    """Problems found (empty when every step's loss and every parameter and buffer equal one process's)."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    ref, batch = build()
    torch.manual_seed(0)
    model, _ = build()
    model.load_state_dict(ref.state_dict())
    ref.train()
    model.train()
    local = replica_batch(batch, rank // (world // dp), dp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, local, plan=strategy, cache_dir="/tmp/nns_test_cache", **options)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    problems = []
    for step in range(steps):
        loss = pm.train_step(local).detach().clone().float()
        if pm.plan.dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        ref_loss = ref(**batch)["loss"]
        ref_loss.backward()
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{strategy} step {step}: loss {loss.item():.7g} vs one process {ref_loss.item():.7g}")
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        full = pm.full_state_dict()
        for k, t in ref.state_dict().items():
            if k not in full:
                problems.append(f"{strategy} step {step}: {k} missing from the parallel state dict")
            elif not torch.allclose(full[k].float(), t.float(), rtol=1e-5, atol=1e-6):
                problems.append(f"{strategy} step {step}: {k} max abs diff "
                                f"{(full[k].float() - t.float()).abs().max().item():.3g}")
        held = {pm.program.shards[key].fqn: key for key in pm.held_keys}
        for k in ("bn1.running_mean", "blocks.1.bn.running_var", "bn3.running_var"):  # every device's own copy
            mine = pm.local_tensor(held[k]) if k in held else None
            if mine is not None and not torch.allclose(mine.float(), ref.state_dict()[k].float(), rtol=1e-5,
                                                       atol=1e-6):
                problems.append(f"{strategy} step {step}: rank {rank}'s {k} differs from one process's")
    return problems


@pytest.mark.parametrize("strategy,options,dp", [
    ("dp", {}, 2), ("zero1", {}, 2), ("zero2", {}, 2), ("zero3", {}, 2), ("tp", {}, 1), ("auto", {}, 1),
    ("gpipe", {"pp": 2, "micro_batches": 1}, 1),
])
def test_batch_norm_trains_like_one_process(workers2, strategy, options, dp):
    problems = workers2.run(_train_like_one_process, strategy, options, dp)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def test_batch_norm_under_hybrid_tp_x_dp(workers4):
    problems = workers4.run(_train_like_one_process, "hybrid", {"tp": 2, "dp": 2}, 2)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def test_local_statistics_are_each_replicas_own(workers2):
    """What the default corrects: with "local" the replicas' losses differ from one process's."""
    problems = workers2.run(_train_like_one_process, "dp", {"batch_statistics": "local"}, 2)
    assert all(any("step 0: loss" in p for p in ps) for ps in problems), problems


def test_recorded_under_every_data_parallel_strategy_and_refused_with_micro_batches():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.lower import lower

    torch.manual_seed(0)
    model, batch = build()
    graph = nns.capture(model.train(), kwargs=batch)
    norms = {op.name for op in graph.ops if "batch_norm" in op.op_name}
    assert len(norms) == 4
    for strategy, world, options in (("dp", 2, {}), ("zero3", 2, {}), ("hybrid", 4, {"tp": 2, "dp": 2}),
                                     ("tp", 2, {})):
        plan = nns.plan(graph, strategy=strategy, world_size=world, **options)
        assert {k for k, v in plan.knobs.batch_statistic_ops.items() if v[0] == "batch_norm"} == norms, strategy
        if plan.dp > 1:
            assert lower(graph, plan).collective_counts(0)["kernel:batch_norm"] == 4, strategy
    for strategy, options in (("dp", {"micro_batches": 2}), ("1f1b", {"pp": 2, "micro_batches": 2})):
        with pytest.raises(PlanError, match=r"micro-batches.*batch norm's mean and variance.*batch_statistics='local'"):
            nns.plan(graph, strategy=strategy, world_size=2, **options)
        local = nns.plan(graph, strategy=strategy, world_size=2, batch_statistics="local", **options)
        assert not local.knobs.batch_statistic_ops
    evaluating = nns.capture(build()[0].eval(), kwargs=batch)  # running statistics used: nothing to combine
    assert not nns.plan(evaluating, strategy="dp", world_size=2, micro_batches=2).knobs.batch_statistic_ops
