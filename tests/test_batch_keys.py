"""A batch entry the captured program does not read is never dropped without a word: a key the
forward does not take is refused as eager PyTorch refuses it, a key it takes that the example did
not have is refused (eager would use it, the program was traced without it), and one the forward
only collects in `**kwargs` is passed through as eager passes it, with a warning."""
from __future__ import annotations

import warnings

import pytest
import torch


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return y.mean()


class _AnyKeywords(_Masked):
    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return self.lin(x).mean()


@pytest.fixture(scope="module")
def masked():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    return nns.parallelize(_Masked(), {"x": torch.randn(2, 4)}, plan="dp", world_size=1)


def test_a_key_the_forward_does_not_take_is_refused_as_eager_refuses_it(masked):
    batch = {"x": torch.randn(2, 4), "y": torch.ones(2)}
    with pytest.raises(TypeError):
        _Masked()(**batch)  # eager
    with pytest.raises(TypeError, match=r"batch key 'y' is not an argument of _Masked.forward \(it takes: mask, x\)"):
        masked.train_step(batch)
    with pytest.raises(TypeError, match="batch key 'y'"):
        masked(**batch)
    assert all(p.grad is None for p in masked.parameters())


def test_a_key_the_example_did_not_have_is_refused(masked):
    with pytest.raises(TypeError, match="batch key 'mask' was not in the example inputs"):
        masked.train_step({"x": torch.randn(2, 4), "mask": torch.zeros(2, 1)})
    masked.train_step({"x": torch.randn(2, 4), "mask": None})  # what the example had: nothing to read


def test_a_key_only_kwargs_collects_is_passed_with_a_warning():
    import nnscaler_plugins as nns

    module = nns.parallelize(_AnyKeywords(), {"x": torch.randn(2, 4)}, plan="dp", world_size=1)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = module.train_step({"x": x, "extra_key": torch.ones(2)})
        module.train_step({"x": x, "extra_key": torch.ones(2)})
    told = [w for w in seen if "batch key 'extra_key'" in str(w.message)]
    assert len(told) == 1 and "**kwargs" in str(told[0].message)
    assert torch.allclose(loss, _AnyKeywords.forward(module_copy(module), x))


def module_copy(module) -> torch.nn.Module:
    ref = _AnyKeywords()
    ref.load_state_dict(module.full_state_dict())
    return ref
