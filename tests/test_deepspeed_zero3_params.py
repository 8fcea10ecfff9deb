"""ZeRO-3 parameters as DeepSpeed scripts handle them: the marks they test, GatheredParameters on the
engine's pieces and on the model's parameters (reads, and writes with modifier_rank, as checkpoint
conversion code does), and a model built under zero.Init compared with the engine it was saved from.

Everything runs on one pool of 2 gloo processes, in training mode.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from nnscaler_plugins.adapters import deepspeed
from nnscaler_plugins.adapters.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

HIDDEN = 10


@pytest.fixture(scope="module")
def workers2(deepspeed_workers2):
    """The DeepSpeed modules' own pool (tests/conftest.py), not the session's shared one."""
    return deepspeed_workers2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def _config(stage: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    cfg.update(extra)
    return cfg


def _batch(rank: int, i: int = 0):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(2, HIDDEN, generator=g), torch.randint(0, HIDDEN, (2,), generator=g)


def _step(engine, rank: int, i: int = 0) -> float:
    """One step on this rank's batch (the ranks of one tensor-parallel unit read the same one)."""
    loss = engine(*_batch(rank * engine.dp_world_size // engine.world_size, i))
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _to_fetch(params) -> list:
    """What DeepSpeed's checkpoint tests gather: parameters marked and not available here."""
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def _gathered(rank, world, plan):
    out = {}
    torch.manual_seed(0)
    model = Net()
    extra = {"nnscaler": {"plan": plan}} if plan != "dp" else {}
    engine = deepspeed.initialize(model=model, config=_config(3, **extra))[0]
    engine.train()
    _step(engine, rank)
    whole = engine.module_state_dict()
    pieces = list(engine.module.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    # a piece is marked exactly when it is not the whole tensor; the model's parameters that are not
    # shared with a whole piece hold no values and are marked
    out["pieces_marked"] = [(hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
                            == (tuple(p.shape) != tuple(whole[n].shape)) for (_, p), n in zip(pieces, names)]
    out["some_marked"] = any(hasattr(p, "ds_id") for _, p in pieces)
    out["model_marked_empty"] = [(hasattr(p, "ds_id") and p.numel() == 0 and p.ds_numel == whole[n].numel()
                                  and tuple(p.ds_shape) == tuple(whole[n].shape)) or torch.equal(p.detach(), whole[n])
                                 for n, p in model.named_parameters()]
    piece_shapes = [tuple(p.shape) for _, p in pieces]
    # reads: the engine's pieces, then the model's parameters, each whole inside the block
    with deepspeed.zero.GatheredParameters([p for _, p in pieces]):
        out["pieces_whole"] = [torch.equal(p.detach(), whole[n]) for (_, p), n in zip(pieces, names)]
        out["pieces_available"] = all(p.ds_status == ZeroParamStatus.AVAILABLE for _, p in pieces
                                      if hasattr(p, "ds_id"))
    out["pieces_back"] = [tuple(p.shape) for _, p in pieces] == piece_shapes
    with deepspeed.zero.GatheredParameters(model.parameters()):
        out["model_whole"] = [torch.equal(p.detach(), whole[n]) for n, p in model.named_parameters()]
    out["model_released"] = all(p.numel() == 0 for p in model.parameters() if hasattr(p, "ds_id"))
    # writes with modifier_rank: what rank 0 writes is what every rank trains on
    with deepspeed.zero.GatheredParameters([p for _, p in pieces], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                pieces[0][1].fill_(0.5)
        else:
            with torch.no_grad():
                pieces[0][1].fill_(-3.0)  # not the modifier: DeepSpeed drops it
    after = engine.module_state_dict()
    out["written"] = bool((after[names[0]] == 0.5).all()) and all(torch.equal(after[n], whole[n]) for n in names[1:])
    # the next step trains from the written weights: as an engine whose model started from them
    torch.manual_seed(1)
    ref_model = Net()
    ref_model.load_state_dict(after)
    ref = deepspeed.initialize(model=ref_model, config=_config(3, **extra))[0]
    ref.train()
    out["trains_on"] = _step(engine, rank, 1) == _step(ref, rank, 1)
    # writing without modifier_rank does not reach the engine: a warning (an error with
    # zero_optimization.enable_sanity_checks), as DeepSpeed drops such writes
    before = engine.module_state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deepspeed.zero.GatheredParameters(model.linears[1].weight):
            with torch.no_grad():
                model.linears[1].weight.add_(1.0)
    out["unannounced"] = " ".join(str(w.message) for w in caught if "in-place modification" in str(w.message))
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    engine.sanity_checks = True  # as zero_optimization.enable_sanity_checks sets it
    try:
        with deepspeed.zero.GatheredParameters(model.linears[1].weight):
            with torch.no_grad():
                model.linears[1].weight.add_(1.0)
        out["checked"] = "no error"
    except RuntimeError as e:
        out["checked"] = str(e)
    out["unchanged"] &= all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    return out


@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_gathered_parameters_give_whole_pieces_and_write_back(workers2, plan) -> None:
    for r in workers2.run(_gathered, plan):
        assert all(r["pieces_marked"]) and r["some_marked"] and all(r["model_marked_empty"]), r
        assert all(r["pieces_whole"]) and r["pieces_available"] and r["pieces_back"], r
        assert all(r["model_whole"]) and r["model_released"], r
        assert r["written"] and r["trains_on"], r
        assert "in-place modification of 1 parameter" in r["unannounced"] and r["unchanged"], r
        assert "in-place modification of 1 parameter" in r["checked"], r


def _zero_init_round_trip(rank, world, tmp, stage):
    """DeepSpeed's checkpoint tests: a model built under zero.Init trains and saves; another, built
    the same way, loads the checkpoint before any forward; their model states compare equal once
    the marked ones are gathered (checkpoint/common.py's compare_model_states)."""
    cfg = _config(stage)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Net()
    trained = deepspeed.initialize(model=model, config=cfg)[0]
    trained.train()
    for i in range(3):
        _step(trained, rank, i)
    trained.save_checkpoint(tmp, tag="1")
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model2 = Net()
    loaded = deepspeed.initialize(model=model2, config=cfg)[0]
    loaded.load_checkpoint(tmp, tag="1", load_optimizer_states=True)
    out = {}
    saved_params = list(trained.module.named_parameters())
    # as DeepSpeed's test compares them (its list of parameters to gather holds (name, parameter)
    # pairs, so it gathers none): both engines' parameters hold no values, alike
    out["direct"] = [torch.allclose(p0, p1, atol=1e-7)
                     for (_, p0), (_, p1) in zip(saved_params, loaded.module.named_parameters())] if stage == 3 else [True]
    loaded_params = list(loaded.module.named_parameters())
    fetch = _to_fetch([p for _, p in saved_params] + [p for _, p in loaded_params])
    with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0):
        out["equal"] = [torch.allclose(p0, p1, atol=1e-7) for (_, p0), (_, p1) in zip(saved_params, loaded_params)]
        out["shapes"] = [(tuple(p0.shape), tuple(p1.shape)) for (_, p0), (_, p1) in zip(saved_params, loaded_params)]
    # and they train on alike
    loaded.train()
    out["next"] = _step(trained, rank, 7) == _step(loaded, rank, 7)
    return out


@pytest.mark.parametrize("stage", [3, 1])
def test_zero_init_model_loads_what_the_engine_saved(workers2, tmp_path, stage) -> None:
    for r in workers2.run(_zero_init_round_trip, str(tmp_path / "ckpt"), stage):
        assert r["equal"] and all(r["equal"]) and all(r["direct"]), r["shapes"]
        assert all(a == b for a, b in r["shapes"]), r["shapes"]
        assert r["next"]


def _before_forward(rank, world):
    """ZeRO-3 from initialize on, before any forward: the model's parameters hold no values and are
    marked; gathered, they are the model's values; what rank 0 writes then is what trains."""
    torch.manual_seed(0)
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = deepspeed.initialize(model=model, config=_config(3))[0]
    engine.train()
    out = {"empty": all(p.numel() == 0 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        out["whole"] = all(torch.equal(p, initial[n]) for n, p in model.named_parameters())
        if rank == 0:
            with torch.no_grad():
                model.linears[0].bias.fill_(0.25)
    out["empty_after"] = all(p.numel() == 0 for p in model.parameters())
    out["saved"] = engine.module_state_dict()["linears.0.bias"].eq(0.25).all().item()
    torch.manual_seed(0)
    ref_model = Net()
    with torch.no_grad():
        ref_model.linears[0].bias.fill_(0.25)
    ref = deepspeed.initialize(model=ref_model, config=_config(1))[0]
    ref.train()
    out["trains_on"] = [_step(engine, rank, i) for i in range(2)] == [_step(ref, rank, i) for i in range(2)]
    return out


def test_zero3_parameters_hold_no_values_from_initialize(workers2) -> None:
    for r in workers2.run(_before_forward):
        assert r == {"empty": True, "whole": True, "empty_after": True, "saved": True, "trains_on": True}, r


def _loose(rank, world):
    """A model built under zero.Init, gathered before any engine: whole and alike on every rank;
    rank 1's write reaches every rank (DeepSpeed's TestGatherUpdate); with the sanity checks of the
    config given to Init, an unannounced write raises."""
    checked = {"zero_optimization": {"stage": 3, "enable_sanity_checks": True}}
    with deepspeed.zero.Init(config_dict_or_path=checked):
        other = torch.nn.Linear(4, 2)
    try:
        with deepspeed.zero.GatheredParameters([other.weight, other.bias]):
            with torch.no_grad():
                other.weight.add_(0.0)
        raised = False
    except RuntimeError as e:
        raised = "in-place modification of 1 parameter" in str(e)
    with deepspeed.zero.Init():
        layer = torch.nn.Linear(4, 2)
    out = {"marked": layer.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE, "raised": raised}
    with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=1):
        out["available"] = layer.weight.ds_status == ZeroParamStatus.AVAILABLE
        values = layer.weight.detach().clone()
        if rank == 1:
            with torch.no_grad():
                layer.weight.zero_()
    with deepspeed.zero.GatheredParameters(layer.weight):
        out["zeros"] = torch.equal(layer.weight, torch.zeros_like(layer.weight))
    return out, values


def test_zero_init_parameters_gathered_before_initialize(workers2) -> None:
    (r0, v0), (r1, v1) = workers2.run(_loose)
    assert torch.equal(v0, v1) and v0.abs().sum() > 0
    for r in (r0, r1):
        assert r == {"marked": True, "raised": True, "available": True, "zeros": True}


def _get_full_grad_zero3(rank, world):
    torch.manual_seed(0)
    model = Net()
    engine = deepspeed.initialize(model=model, config=_config(3))[0]
    engine.train()
    loss = engine(*_batch(rank))
    engine.backward(loss)
    grads = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    engine.step()
    return {n: g.clone() for n, g in grads.items()}, {n: p.ds_shape for n, p in model.named_parameters()}


def _reference_grads(batches: list) -> dict:
    torch.manual_seed(0)
    model = Net()
    loss = sum(model(*b) for b in batches) / len(batches)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_safe_get_full_grad_gathers_zero3_pieces(workers2) -> None:
    results = workers2.run(_get_full_grad_zero3)
    ref = _reference_grads([_batch(r) for r in range(2)])
    names = list(ref)
    for grads, shapes in results:
        for piece_name, n in zip(grads, names):
            assert tuple(grads[piece_name].shape) == tuple(shapes[n])
            torch.testing.assert_close(grads[piece_name], ref[n], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))


class WithUnused(Net):
    """Net with a layer its forward never reads (DeepSpeed's TestZeroToFP32 model has one)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 1)


def _unused(rank, world):
    """ZeRO-3: a parameter the forward never reads keeps its values, whole, and GatheredParameters
    gives it as it was made."""
    torch.manual_seed(0)
    model = WithUnused()
    made = model.unused.weight.detach().clone()
    engine = deepspeed.initialize(model=model, config=_config(3))[0]
    engine.train()
    _step(engine, rank)
    with deepspeed.zero.GatheredParameters([model.unused.weight, model.linears[0].weight]):
        gathered = torch.equal(model.unused.weight.detach(), made)
        other_whole = tuple(model.linears[0].weight.shape) == (HIDDEN, HIDDEN)
    return {"gathered": gathered, "other_whole": other_whole,
            "kept": torch.equal(model.unused.weight.detach(), made)}


def test_zero3_unused_parameter_keeps_its_values(workers2) -> None:
    for r in workers2.run(_unused):
        assert r == {"gathered": True, "other_whole": True, "kept": True}, r
