"""What `train_step` gives back and refuses about the loss.

- A forward whose output is not a scalar loss (logits, a tuple of tensors, a `loss_fn=` that
  returns a vector) is refused by name before the step runs, instead of torch's "grad can be
  implicitly created only for scalar outputs" (or, under a pipeline, a backward of the logits' sum).
- The returned loss is the global batch's on every rank, replicas holding different numbers of
  samples included, as eager PyTorch on the whole batch gives; `local_loss` holds this replica's.
"""
from __future__ import annotations

import pytest
import torch

import models


class _Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _TwoLogits(_Logits):
    def forward(self, x: torch.Tensor) -> tuple:
        y = super().forward(x)
        return y, y * 2


def test_a_forward_that_returns_logits_is_named():
    import nnscaler_plugins as nns

    batch = {"x": torch.randn(2, 4)}
    for model, what in ((_Logits(), "a tensor of shape [2, 3]"), (_TwoLogits(), "a tuple of 2")):
        module = nns.parallelize(model, batch, plan="dp", world_size=1)
        with pytest.raises(TypeError, match="forward returned " + what.replace("[", r"\[").replace("]", r"\]")) as e:
            module.train_step(batch)
        assert "return the loss, or pass loss_fn=" in str(e.value)
        assert all(p.grad is None for p in module.parameters())  # refused before anything ran


def test_the_eager_executor_names_a_forward_that_returns_logits_too():
    import nnscaler_plugins as nns

    batch = {"x": torch.randn(2, 4)}
    for model, what in ((_Logits(), r"a tensor of shape \[2, 3\]"), (_TwoLogits(), "a tuple of 2")):
        module = nns.parallelize(model, batch, plan="dp", world_size=1, executor="eager")
        assert module.eager is not None
        with pytest.raises(TypeError, match=f"forward returned {what}.*not a scalar loss"):
            module.train_step(batch)


def test_a_loss_fn_that_returns_a_vector_is_named():
    import nnscaler_plugins as nns

    batch = {"x": torch.randn(2, 4)}
    module = nns.parallelize(_Logits(), batch, plan="dp", world_size=1,
                             loss_fn=lambda out, b: (out ** 2).mean(dim=-1))
    with pytest.raises(TypeError, match=r"loss_fn returned a tensor of shape \[2\], not a scalar loss"):
        module.train_step(batch)
    ok = nns.parallelize(_Logits(), batch, plan="dp", world_size=1, loss_fn=lambda out, b: (out ** 2).mean())
    assert ok.train_step(batch).ndim == 0


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _pipeline_logits(rank: int, world: int) -> str:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model = _Stack()
    batch = (torch.randn(4, 8),)
    module = nns.parallelize(model, batch, plan="1f1b", pp=2, micro_batches=2, cache_dir="/tmp/nns_test_cache")
    try:
        module.train_step(batch)
    except TypeError as e:
        return str(e)
    return "trained on the logits"


def test_a_pipeline_whose_last_stage_returns_logits_is_named(workers2):
    for message in workers2.run(_pipeline_logits):
        assert message.startswith("forward returned a tensor of shape [2, 8], not a scalar loss"), message  # a micro-batch


def _uneven_replicas(rank: int, world: int, strategy: str, options: dict) -> list[str]:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    ref, example = models.mlp()
    model, _ = models.mlp()
    model.load_state_dict(ref.state_dict())
    module = nns.parallelize(model, example, plan=strategy, cache_dir="/tmp/nns_test_cache", **options)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    problems = []
    for step, sizes in enumerate([(3, 1), (1, 4)]):
        g = torch.Generator().manual_seed(step)
        whole = {"x": torch.randn(sum(sizes), 16, generator=g), "labels": torch.randint(0, 8, (sum(sizes),), generator=g)}
        lo = sum(sizes[:rank])
        mine = {k: v[lo:lo + sizes[rank]] for k, v in whole.items()}
        with torch.no_grad():
            own = ref(**mine)
        ref_loss = ref(**whole)
        ref_loss.backward()
        loss = module.train_step(mine)
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{strategy} step {step} rank {rank}: train_step {loss.item():.7g}, whole batch "
                            f"{ref_loss.item():.7g}")
        if not torch.allclose(module.local_loss, own, rtol=1e-5, atol=1e-6):
            problems.append(f"{strategy} step {step} rank {rank}: local_loss {module.local_loss.item():.7g}, "
                            f"own batch {own.item():.7g}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = module.full_state_dict()
    for k, t in ref.state_dict().items():
        if not torch.allclose(full[k], t, rtol=1e-5, atol=1e-6):
            problems.append(f"{strategy}: {k} differs from one process on the whole batch")
    return problems


@pytest.mark.parametrize("strategy,options", [("dp", {}), ("dp", {"zero": 3})], ids=["dp", "zero3"])
def test_train_step_returns_the_global_batch_loss_on_every_rank(workers2, strategy, options):
    problems = workers2.run(_uneven_replicas, strategy, options)
    assert not [p for ps in problems for p in ps], problems
