"""A flag or number passed to the forward is part of what the captured program was traced with.

The example gives `scale=1.0` and no `squash` (its default, False): the program holds both as constants,
as it holds a Python branch on them. A later call with `squash=True` or `scale=2.0` is not the program's
to run: under dp (the model's own forward can take any call) it runs eagerly and equals eager PyTorch,
in a training step and in a forward outside one; under tp (layers split, no fallback) it is refused by
name. A call that leaves out a setting the example gave runs with the forward's default, so it is
compared the same way. Before, the program ran and ignored the flag: a silent wrong answer.
"""
from __future__ import annotations

import pytest
import torch

from sgd_check import step_and_compare


class Settable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0, squash: bool = False) -> torch.Tensor:
        h = torch.relu(self.inp(x)) * scale
        if squash:
            h = torch.tanh(h)
        return torch.nn.functional.mse_loss(self.out(h), y)


def _batch(seed: int, **settings) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 4, generator=g), **settings}


CALLS = [{"scale": 1.0}, {"scale": 1.0, "squash": True}, {"scale": 2.0}, {"scale": 1.0, "squash": False}, {}]


def settings_are_honoured(rank: int, world: int) -> tuple[list[str], list[bool], str]:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, ref = Settable(), Settable()
    ref.load_state_dict(model.state_dict())
    pm = nns.parallelize(model, _batch(0, scale=1.0), plan="dp", cache_dir="/tmp/nns_test_cache")
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    problems, eager = [], []
    for step, settings in enumerate(CALLS):
        parts = [_batch(10 * step + r, **settings) for r in range(world)]
        ref_loss = sum(ref(**p) for p in parts) / world
        ref_loss.backward()
        loss = pm.train_step(parts[rank]).detach().clone()
        eager.append(pm._last_forward[2])
        problems += step_and_compare(pm, ref, (opt, ref_opt), loss, ref_loss, f"dp step {step} {settings}")
    with torch.no_grad():
        b = _batch(7, scale=0.5, squash=True)
        got, want = pm(**b), ref(**b)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            problems.append(f"forward outside a step: {got.item()} vs {want.item()}")

    # an example giving scale=0.5, a call leaving it out: eager runs the forward's default, 1.0
    other = Settable()
    other.load_state_dict(ref.state_dict())
    pm2 = nns.parallelize(other, _batch(0, scale=0.5), plan="dp", cache_dir="/tmp/nns_test_cache")
    with torch.no_grad():
        b = _batch(8)
        got, want = pm2(**b), ref(**b)
        eager.append(pm2.eager is not None)  # the eager executor is bound at its first forward
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            problems.append(f"a setting left out: {got.item()} vs {want.item()}")

    tp = nns.parallelize(Settable(), _batch(0, scale=1.0), plan="tp", cache_dir="/tmp/nns_test_cache")
    try:
        tp(**_batch(1, scale=1.0, squash=True))
        refusal = ""
    except TypeError as e:
        refusal = str(e)
    return problems, eager, refusal


def test_a_setting_the_program_was_not_traced_with_runs_eagerly_or_is_refused(workers2):
    for problems, eager, refusal in workers2.run(settings_are_honoured, timeout=240):
        assert not problems, problems
        assert eager == [False, True, True, False, False, True], eager
        assert "squash=True" in refusal and "False" in refusal, refusal
