"""`nns.build_optimizer` builds torch's optimizers with their fused kernel where torch has one, keeps the
caller's own choice, and trains as torch's default implementation does (to fp32 rounding)."""
from __future__ import annotations

import copy

import pytest
import torch

import models
import nnscaler_plugins as nns
from nnscaler_plugins.runtime.fused_optimizer import fused_by_default


def _module(model: torch.nn.Module, batch: dict):
    return nns.parallelize(model, batch, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_torchs_optimizers_are_fused_unless_the_caller_chose(cls):
    torch.manual_seed(0)
    model, batch = models.mlp()
    module = _module(model, batch)
    extra = {"momentum": 0.9} if cls is torch.optim.SGD else {}
    assert nns.build_optimizer(module, cls, lr=1e-3, **extra).param_groups[0]["fused"] is True
    assert not nns.build_optimizer(module, cls, lr=1e-3, fused=False, **extra).param_groups[0]["fused"]
    chosen = nns.build_optimizer(module, cls, lr=1e-3, foreach=True, **extra).param_groups[0]
    assert chosen["foreach"] is True and not chosen["fused"]


def test_what_torch_has_no_fused_kernel_for_is_left_as_it_is():
    class MyAdamW(torch.optim.AdamW):  # a subclass's step may not take the flag
        pass

    w = torch.zeros(3)
    assert not fused_by_default(MyAdamW, [w], {})
    assert not fused_by_default(torch.optim.RMSprop, [w], {})
    assert not fused_by_default(torch.optim.AdamW, [w.to(torch.int64)], {})
    assert not fused_by_default(torch.optim.AdamW, [w.to("meta")], {})
    assert not fused_by_default(torch.optim.AdamW, [w], {}, [{"params": ["a"], "foreach": False}])
    assert fused_by_default(torch.optim.AdamW, [w], {"lr": 1e-3})


def test_the_fused_step_trains_as_torchs_default_loop_in_training_mode():
    """Dropout on (training mode), five AdamW steps with weight decay: the fused masters end within fp32
    rounding of torch's default implementation over the same gradients."""
    torch.manual_seed(0)
    model, batch = models.gpt2_small()
    model.train()
    reference = copy.deepcopy(model)
    module = _module(model, batch)
    opt = nns.build_optimizer(module, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    assert opt.param_groups[0]["fused"] is True
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    assert not ref_opt.param_groups[0]["fused"]
    named = {}  # the module's name of each reference parameter (a tied weight goes by one of its names)
    for n, p in reference.named_parameters(remove_duplicate=False):
        if module.parameter(n) is not None:
            named[n] = p
    assert len({id(p) for p in named.values()}) == len(list(reference.parameters()))
    for step in range(5):
        module.train_step(batch)
        for fqn in named:  # the reference steps over the very gradients the module's step reads
            named[fqn].grad = module.parameter(fqn).grad.detach().clone()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    worst = max(((module.parameter(n).detach() - p.detach()).abs().max() / p.detach().abs().max()).item()
                for n, p in named.items())
    assert 0 < worst < 1e-5, worst  # not bit-equal (another kernel), and within rounding
