"""One check many tests share: train a model under a plan on real workers with SGD and compare,
step by step, the global loss and every whole parameter with one process on the global batch.

Run `sgd_equivalence(rank, world, build, strategy, options, dp)` inside a worker task: `build()`
returns (model, global_batch) and is called twice with the same seed (reference and parallel
copy), so it must build deterministically.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def replica_batch(batch: dict, replica: int, dp: int) -> dict:
    n = next(iter(batch.values())).shape[0] // dp
    return {k: v[replica * n:(replica + 1) * n] for k, v in batch.items()}


def step_and_compare(pm: Any, ref: torch.nn.Module, opts: tuple, loss: torch.Tensor, ref_loss: torch.Tensor,
                     label: str) -> list[str]:
    """Compare the global loss with the reference's, step both optimizers, then compare every whole
    parameter (fp32, relative 1e-5): the check every SGD equivalence test makes after a step."""
    problems = []
    if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
        problems.append(f"{label}: loss {loss.item():.7g} vs {ref_loss.item():.7g}")
    for opt in opts:
        opt.step()
        opt.zero_grad()
    full = pm.full_state_dict()
    for k, t in ref.state_dict().items():
        if k in full and not torch.allclose(full[k].float(), t.float(), rtol=1e-5, atol=1e-6):
            problems.append(f"{label}: {k} max abs diff {(full[k].float() - t.float()).abs().max().item():.3g}")
    return problems


def sgd_equivalence(rank: int, world: int, build: Callable[[], tuple[torch.nn.Module, dict]], strategy: Any,
                    options: dict, dp: int, steps: int = 2, lr: float = 0.1, what: str = "",
                    cache_dir: str = "/tmp/nns_test_cache", training: bool = False,
                    batch_of_step: Optional[Callable[[int], dict]] = None,
                    with_inputs: Optional[Callable[[dict], dict]] = None) -> list[str]:
    """Problems found (empty when the plan trains exactly like one process).

    `training=True` keeps the models in training mode (for models whose dropout rates are 0: pieces
    would draw other masks than the reference otherwise). `batch_of_step(i)`: the global batch of
    step i from the second on (default: the first batch again), for what must follow the data.
    `with_inputs(batch)`: the batch the model takes, made from a replica's rows and from the whole
    batch for the reference (inputs built outside the model from the batch, like a block mask)."""
    with_inputs = with_inputs or (lambda b: b)
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    ref, batch = build()
    torch.manual_seed(0)
    model, _ = build()
    model.load_state_dict(ref.state_dict())
    ref.train(training)
    model.train(training)
    local = replica_batch(batch, rank // (world // dp), dp)
    pm = nns.parallelize(model, with_inputs(local), plan=strategy, cache_dir=cache_dir, **options)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    label = what or f"{strategy} {options}"
    problems: list[str] = []
    for step in range(steps):
        if step and batch_of_step is not None:
            batch = batch_of_step(step)
            local = replica_batch(batch, rank // (world // dp), dp)
        loss = pm.train_step(with_inputs(local)).detach().clone().float()
        if pm.plan.dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        ref_loss = extract_loss(ref(**with_inputs(batch)))
        ref_loss.backward()
        problems += step_and_compare(pm, ref, (opt, ref_opt), loss, ref_loss, f"{label} step {step}")
    return problems
