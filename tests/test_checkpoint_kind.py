"""A checkpoint saved with another optimizer class or under another precision is refused by name
before anything changes (SGD's state loaded into AdamW would step on a missing `exp_avg`); one of
another model is refused by its names and shapes (test_checkpoint covers the listing)."""
from __future__ import annotations

import pytest
import torch

import models


def _module(precision: str = "fp32"):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.mlp()
    return nns.parallelize(model, batch, plan="dp", world_size=1, precision=precision), batch


def _weights(module) -> dict:
    return {k: v.clone() for k, v in module.full_state_dict().items()}


def test_another_optimizer_class_is_refused_before_anything_changes(tmp_path):
    import nnscaler_plugins as nns

    module, batch = _module()
    sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module.train_step(batch)
    sgd.step()
    nns.checkpoint.save(tmp_path / "ck", module, sgd)

    other, _ = _module()
    adamw = torch.optim.AdamW(other.parameters(), lr=0.1)
    before = _weights(other)
    with pytest.raises(nns.checkpoint.CheckpointError, match=r"optimizer state is SGD's .* this optimizer is AdamW"):
        nns.checkpoint.load(tmp_path / "ck", other, adamw)
    assert all(torch.equal(before[k], v) for k, v in other.full_state_dict().items())
    assert not adamw.state
    nns.checkpoint.load(tmp_path / "ck", other)  # the weights alone still load
    same = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    nns.checkpoint.load(tmp_path / "ck", other, same)
    assert same.state


def test_the_class_under_build_optimizer_is_what_counts(tmp_path):
    import nnscaler_plugins as nns

    module, batch = _module()
    opt = nns.build_optimizer(module, torch.optim.SGD, lr=0.1)
    module.train_step(batch)
    opt.step()
    nns.checkpoint.save(tmp_path / "ck", module, opt)
    other, _ = _module()
    with pytest.raises(nns.checkpoint.CheckpointError, match="this optimizer is Adam "):
        nns.checkpoint.load(tmp_path / "ck", other, nns.build_optimizer(other, torch.optim.Adam, lr=0.1))
    nns.checkpoint.load(tmp_path / "ck", other, torch.optim.SGD(other.parameters(), lr=0.1))


def test_another_precision_is_refused_unless_allowed(tmp_path):
    import nnscaler_plugins as nns

    module, batch = _module("bf16")
    nns.checkpoint.save(tmp_path / "ck", module)
    other, _ = _module()
    before = _weights(other)
    with pytest.raises(nns.checkpoint.CheckpointError, match="saved under precision 'bf16', this module's plan has 'fp32'"):
        nns.checkpoint.load(tmp_path / "ck", other)
    assert all(torch.equal(before[k], v) for k, v in other.full_state_dict().items())
    nns.checkpoint.load(tmp_path / "ck", other, allow_precision_change=True)
    saved = module.full_state_dict()
    assert all(torch.equal(saved[k].float(), v) for k, v in other.full_state_dict().items())
