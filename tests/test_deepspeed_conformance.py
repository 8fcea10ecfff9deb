"""The DeepSpeed drop-in against what DeepSpeed's own unit tests check of its engine.

Each test names the DeepSpeed test it follows (tests/unit/runtime/... in DeepSpeed's repository):
the same calls a script makes, checked for what DeepSpeed's test checks, written for this engine.
Tests of DeepSpeed's internal classes (FusedAdam, its ZeRO optimizer objects, its partitioned
parameter attributes) have no counterpart here. `deepspeed_conformance_inventory.md` beside this
file lists every DeepSpeed test of those files, the test here that mirrors it, and its status.
Everything runs on one pool of 2 gloo processes; the stage x precision sweeps run whole with
NNS_TEST_ALL_PLANS=1.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from nnscaler_plugins.adapters import deepspeed
from nnscaler_plugins.adapters.deepspeed.config import DeepSpeedConfigError, load_config, translate

ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
HIDDEN = 8


@pytest.fixture(scope="module")
def workers2(deepspeed_workers2):
    """The DeepSpeed modules' own pool (tests/conftest.py), not the session's shared one."""
    return deepspeed_workers2


class SimpleModel(torch.nn.Module):
    """DeepSpeed's tests' SimpleModel: linear layers and a cross-entropy loss."""

    def __init__(self, hidden: int = HIDDEN, nlayers: int = 2):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(nlayers)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def _model(seed: int = 0) -> SimpleModel:
    torch.manual_seed(seed)
    return SimpleModel()


def _batches(n: int, rank: int, dtype: torch.dtype = torch.float32, batch: int = 2) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, HIDDEN, generator=g).to(dtype), torch.randint(0, HIDDEN, (batch,), generator=g))
            for _ in range(n)]


def _config(stage: int = 0, precision: str = "fp32", **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # test_no_sync_ctxt's fp16 section
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    cfg.update(extra)
    return cfg


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _train(engine, batches) -> list:
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weight_decay_groups(model: torch.nn.Module) -> list:
    """DeepSpeed users' usual groups: weight decay on matrices, none on biases."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0,
             "lr": 0.02}]


# -- test_ds_initialize.py ---------------------------------------------------------------------------

def _initialize_cases(rank, world):
    from torch.optim.lr_scheduler import LambdaLR

    from nnscaler_plugins.adapters.deepspeed.zero_optimizer import ZeroOptimizer

    out = {}
    # TestNoOptim: no optimizer, bf16, offload_param, the model built under zero.Init(enabled=stage == 3)
    for stage in (0, 3):
        cfg = {"train_batch_size": world, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # offload_param under stage 0 is ignored with a warning, as in DeepSpeed
            with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=cfg):
                model = SimpleModel(nlayers=4)
            engine, opt, _, _ = deepspeed.initialize(model=model, config=cfg)
        out[f"no_optim_{stage}"] = (opt is None or isinstance(opt, ZeroOptimizer),
                                    all(torch.isfinite(engine(x, y)).item()
                                        for x, y in _batches(2, rank, torch.bfloat16, batch=1)))
    # TestClientOptimizer: an object is handed back as it is, a callable is called
    model = _model()
    client = torch.optim.Adam(model.parameters())
    _, opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config={"train_batch_size": world},
                                        model_parameters=list(model.parameters()))
    out["client_object"] = opt is client
    model = _model()
    _, opt, _, _ = deepspeed.initialize(model=model, optimizer=lambda ps: torch.optim.AdamW(ps),
                                        config={"train_batch_size": world}, model_parameters=list(model.parameters()))
    out["client_callable"] = type(opt).__name__ == "AdamW"
    # TestConfigOptimizer: the config's optimizer, with or without model_parameters
    for given in (True, False):
        model = _model()
        _, opt, _, _ = deepspeed.initialize(model=model, config={"train_batch_size": world, "optimizer": {
            "type": "Adam", "params": {"lr": 0.001}}}, model_parameters=list(model.parameters()) if given else None)
        out[f"config_optimizer_{given}"] = opt is not None and opt.param_groups[0]["lr"] == 0.001
    # TestOptimizerImplementation (the wrappers that exist without a grad_accum_dtype): ZeRO 1-3 x fp32/bf16
    ok = []
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            model = _model()
            deepspeed.initialize(model=model, config=_config(stage, precision), model_parameters=model.parameters())
            ok.append((stage, precision))
    out["implementations"] = len(ok)
    # TestBf16ZeRO0UnfusedOptimizer: gradients after backward, none after step
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config={"train_batch_size": world, "bf16": {"enabled": True}})
    x, y = _batches(1, rank, torch.bfloat16, batch=1)[0]
    loss = engine(x, y)
    engine.backward(loss)
    had = any(p.grad is not None for p in engine.module.parameters() if p.requires_grad)
    engine.step()
    out["bf16_grads"] = (had, all(p.grad is None for p in engine.module.parameters() if p.requires_grad),
                         loss.dtype == torch.bfloat16)
    # TestClientLrScheduler: 3 optimizer kinds x 3 scheduler kinds
    lam = lambda epoch: epoch // 10  # noqa: E731
    results = {}
    for opt_kind in ("config", "object", "callable"):
        for sched_kind in ("config", "object", "callable"):
            model = _model()
            cfg = {"train_batch_size": world}
            client_opt = None
            if opt_kind == "config":
                cfg["optimizer"] = {"type": "Adam"}
            elif opt_kind == "object":
                client_opt = torch.optim.Adam(model.parameters())
            else:
                client_opt = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
            client_sched = None
            if sched_kind == "config":
                cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
            elif sched_kind == "object":
                client_sched = LambdaLR(client_opt if isinstance(client_opt, torch.optim.Optimizer)
                                        else torch.optim.Adam(model.parameters()), lam)
            else:
                client_sched = lambda o: LambdaLR(o, lam)  # noqa: E731
            try:
                _, _, _, sched = deepspeed.initialize(model=model, config=cfg, optimizer=client_opt,
                                                      lr_scheduler=client_sched,
                                                      model_parameters=list(model.parameters()))
                if sched_kind == "config":
                    results[(opt_kind, sched_kind)] = type(sched).__name__ == "WarmupLR"
                elif sched_kind == "object":
                    results[(opt_kind, sched_kind)] = sched is client_sched
                else:
                    results[(opt_kind, sched_kind)] = isinstance(sched, LambdaLR)
            except AssertionError:
                results[(opt_kind, sched_kind)] = "assert"
    out["lr_schedulers"] = results
    # TestClientLrSchedulerInit: a client scheduler (object or callable) wins over the config's
    from torch.optim.lr_scheduler import OneCycleLR, StepLR

    init_results = []
    for config_sched, make_object, make_callable in (
            ({"type": "WarmupLR", "params": {}}, lambda o: LambdaLR(o, lam), lambda o: LambdaLR(o, lam)),
            ({"type": "WarmupLR", "params": {}}, lambda o: LambdaLR(o, lam), lambda o: StepLR(o, step_size=30)),
            ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1}}, lambda o: StepLR(o, step_size=30),
             lambda o: OneCycleLR(o, max_lr=0.01, total_steps=200))):
        for kind in ("config", "object", "callable"):
            model = _model()
            client_opt = torch.optim.Adam(model.parameters(), lr=0.01)
            cfg = {"train_batch_size": world}
            sched = None
            if kind == "config":
                cfg["scheduler"] = config_sched
            elif kind == "object":
                sched = make_object(client_opt)
            else:
                sched = make_callable
            got = deepspeed.initialize(config=cfg, model=model, model_parameters=list(model.parameters()),
                                       optimizer=client_opt, lr_scheduler=sched)[3]
            expected = {"config": config_sched["type"], "object": type(sched).__name__ if kind == "object" else None,
                        "callable": type(make_callable(torch.optim.Adam(_model().parameters()))).__name__}[kind]
            init_results.append(type(got).__name__ == expected)
    out["lr_scheduler_init"] = init_results
    # a scheduler on torch's old `_LRScheduler` base without its optimizer object: DeepSpeed asserts
    old_base = getattr(torch.optim.lr_scheduler, "_LRScheduler")

    class OldStyle(old_base):
        def get_lr(self):
            return [g["lr"] for g in self.optimizer.param_groups]

    model = _model()
    try:
        deepspeed.initialize(model=model, config={"train_batch_size": world, "optimizer": {"type": "Adam"}},
                             lr_scheduler=OldStyle(torch.optim.Adam(model.parameters())))
        out["old_base_asserts"] = False
    except AssertionError:
        out["old_base_asserts"] = True
    # initialize(model=None) asserts, as DeepSpeed's does
    try:
        deepspeed.initialize(model=None, config={"train_batch_size": world})
        out["model_none"] = False
    except AssertionError:
        out["model_none"] = True
    return out


def test_initialize_follows_test_ds_initialize(workers2) -> None:
    for r in workers2.run(_initialize_cases):
        assert r["no_optim_0"] == (True, True) and r["no_optim_3"] == (True, True)
        assert r["client_object"] and r["client_callable"]
        assert r["config_optimizer_True"] and r["config_optimizer_False"]
        assert r["implementations"] == 8
        assert r["bf16_grads"] == (True, True, True)
        for (opt_kind, sched_kind), ok in r["lr_schedulers"].items():
            # DeepSpeed 0.19.8 asserts only for schedulers on torch's old `_LRScheduler` base; LambdaLR is
            # not one, so it is taken as it is even without its optimizer object
            assert ok is True, (opt_kind, sched_kind)
        assert r["model_none"]
        assert r["lr_scheduler_init"] == [True] * 9
        assert r["old_base_asserts"]


# -- checkpoint/test_*.py: round trips -----------------------------------------------------------------

def _state(engine) -> dict:
    return {k: v.float().clone() for k, v in engine.module_state_dict().items()}


def _optimizer_state(engine) -> dict:
    """Every parameter's optimizer state by the parameter's name, whichever optimizer holds it (the
    plan's one under ZeRO or bf16, the torch one otherwise), so stages compare with each other."""
    opt = engine.optimizer
    inner = getattr(opt, "inner", opt)
    if hasattr(inner, "full_state_dict"):
        state = inner.full_state_dict()["state"].items()
    else:
        state = ((engine.name_of(p), s) for p, s in inner.state.items())
    return {n: {k: v.float().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for n, s in state}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _round_trip(rank, world, tmp, case):
    save_stage, load_stage, precision, how = case
    dt = _dtype(precision)
    batches = _batches(3, rank, dt)
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    if how == "onecycle":  # checkpoint/test_lr_scheduler.py: OneCycle's lr and momentum cycles resume too
        sched = {"type": "OneCycle", "params": {"cycle_first_step_size": 2, "cycle_first_stair_count": 1,
                                                "cycle_second_step_size": 2, "decay_step_size": 2,
                                                "cycle_min_lr": 0.0001, "cycle_max_lr": 0.001, "decay_lr_rate": 0.001,
                                                "cycle_min_mom": 0.85, "cycle_max_mom": 0.99}}
    cfg = _config(save_stage, precision, scheduler=sched)
    load_zero = {"stage": load_stage}
    if how.startswith("offload"):  # checkpoint/test_zero_optimizer.py's cpu_offload cases, on save and load
        cfg["zero_optimization"]["cpu_offload"] = load_zero["cpu_offload"] = True
    if how.startswith("elastic"):  # TestZeROElasticCheckpoint: elastic_checkpoint on save / on load
        cfg["zero_optimization"]["elastic_checkpoint"] = how[-3] == "1"
        load_zero["elastic_checkpoint"] = how[-2] == "1"
    if how == "fp32_weights":  # TestZeROStage3ElasticCheckpoint.test_elastic_checkpoint_load_from_fp32_weights
        cfg["zero_optimization"].update(elastic_checkpoint=True, load_from_fp32_weights=True)
        load_zero.update(elastic_checkpoint=True, load_from_fp32_weights=True)
    if how == "zero_init":  # test_pipeline_checkpoint_loading: models built under zero.Init, module only
        load_zero["pipeline_loading_checkpoint"] = True
    with deepspeed.zero.Init(enabled=how == "zero_init"):
        model = _model()
    trained, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=_weight_decay_groups(model))
    _train(trained, batches)
    trained.empty_partition_cache()
    tag = None if how == "empty_tag" else "1"
    trained.save_checkpoint(tmp, tag=tag, client_state={"epoch": 3})
    with deepspeed.zero.Init(enabled=how == "zero_init"):
        model = _model(seed=1)  # other initial weights: the load must replace them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # elastic_checkpoint / pipeline_loading_checkpoint: knobs without effect
        loaded, _, _, _ = deepspeed.initialize(model=model, config=_config(load_stage, precision, scheduler=sched,
                                                                           zero_optimization=load_zero),
                                               model_parameters=_weight_decay_groups(model))
    kwargs = {"load_optimizer_states": how not in ("no_optimizer", "offload_no_optimizer", "module_only", "zero_init",
                                                   "elastic000",
                                                   "elastic010", "elastic100", "elastic110"),
              "load_module_only": how in ("module_only", "zero_init"),
              "load_lr_scheduler_states": how != "no_scheduler"}
    if how == "empty_tag":  # test_latest_checkpoint's compile_mode: the same after engine.compile()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded.compile()
    same_dtype = next(iter(trained.parameters())).dtype == next(iter(loaded.parameters())).dtype
    path, client = loaded.load_checkpoint(tmp, tag=tag, **kwargs)
    before_forward = _same(_state(trained), _state(loaded))  # weights apply at once, before any forward
    out = {"dtype": same_dtype, "path": os.path.basename(path), "client": client.get("epoch"),
           "module": before_forward, "steps": (trained.global_steps, loaded.global_steps),
           "lr": (trained.get_lr(), loaded.get_lr()),
           "scheduler": (trained.lr_scheduler.state_dict(), loaded.lr_scheduler.state_dict())}
    # one more step on each: equal when the optimizer state came along too
    more = _batches(1, rank + 7, dt)
    a, b = _train(trained, more), _train(loaded, more)
    out["next_loss_equal"] = a == b
    out["optimizer"] = _same(_optimizer_state(trained), _optimizer_state(loaded))
    out["module_after"] = _same(_state(trained), _state(loaded))
    return out


ROUND_TRIPS = [(0, 0, "fp32", "full"), (2, 2, "bf16", "full"), (3, 3, "fp32", "empty_tag"),
               (1, 3, "fp32", "full"), (3, 1, "bf16", "full"), (2, 2, "fp32", "no_optimizer"),
               (0, 0, "bf16", "module_only"), (1, 1, "fp32", "no_scheduler"), (2, 2, "fp32", "onecycle"),
               (3, 3, "bf16", "zero_init"), (2, 2, "bf16", "elastic101"), (3, 3, "bf16", "offload_full")]
if ALL:
    ROUND_TRIPS += [(s, t, p, h) for s in (0, 1, 2, 3) for t in (0, 1, 2, 3) for p in ("fp32", "bf16")
                    for h in ("full",) if (s, t, p, h) not in ROUND_TRIPS]
    ROUND_TRIPS += [(2, 2, "bf16", f"elastic{a}{b}{c}") for a in (0, 1) for b in (0, 1) for c in (0, 1)
                    if (2, 2, "bf16", f"elastic{a}{b}{c}") not in ROUND_TRIPS]
    ROUND_TRIPS += [(s, s, p, h) for s in (0, 1, 2, 3) for p in ("fp32", "bf16")
                    for h in ("no_optimizer", "module_only", "no_scheduler", "empty_tag")
                    if (s, s, p, h) not in ROUND_TRIPS]
    # test_load_optimizer_state / test_not_load_optimizer_state with cpu_offload; TestZeROStage3ElasticCheckpoint
    ROUND_TRIPS += [(s, s, "bf16", h) for s in (2, 3) for h in ("offload_full", "offload_no_optimizer")
                    if (s, s, "bf16", h) not in ROUND_TRIPS]
    ROUND_TRIPS += [(3, 3, "bf16", h) for h in ("elastic111", "elastic110", "elastic101", "fp32_weights")]


def test_checkpoint_round_trips_follow_deepspeeds_checkpoint_tests(workers2, tmp_path) -> None:
    for i, case in enumerate(ROUND_TRIPS):
        save_stage, load_stage, precision, how = case
        for r in workers2.run(_round_trip, str(tmp_path / f"ckpt{i}"), case):
            assert r["dtype"], case
            assert r["path"] == ("global_step3" if how == "empty_tag" else "1"), case
            assert r["module"], f"{case}: weights differ after load_checkpoint, before any forward"
            if how in ("module_only", "zero_init"):
                assert r["client"] == 3 and r["steps"][1] == 0, case
                continue
            assert r["client"] == 3 and r["steps"] == (3, 3), case
            # compare_lr_scheduler_states: the scheduler's state; the lr itself comes with the optimizer's
            assert (r["scheduler"][0] == r["scheduler"][1]) == (how != "no_scheduler"), case
            if how in ("full", "empty_tag", "onecycle", "offload_full", "fp32_weights") or how.endswith("1"):
                assert r["lr"][0] == r["lr"][1], case
                assert r["optimizer"] and r["next_loss_equal"] and r["module_after"], case


# -- zero_to_fp32 reads these checkpoints; they load back under another world size ------------------

def _save_for_zero_to_fp32(rank, world, tmp, stage, precision):
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, precision),
                                           model_parameters=_weight_decay_groups(model))
    _train(engine, _batches(2, rank, _dtype(precision)))
    engine.save_checkpoint(tmp)
    opt = engine.optimizer.inner
    full = opt.full_state_dict()["state"]
    masters = {n: s["master_param"].float() if "master_param" in s else None for n, s in full.items()}
    state = _state(engine)
    return {n: (m if m is not None else state[n]) for n, m in masters.items()}


ZERO_TO_FP32 = """
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
for directory in sys.argv[1:]:
    sd = get_fp32_state_dict_from_zero_checkpoint(directory)
    torch.save({k: v.float().clone() for k, v in sd.items()}, directory + ".fp32.pt")
"""


def _zero_to_fp32(directories: list) -> list:
    """DeepSpeed's reader, in its own process (importing DeepSpeed patches torch for the process)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ZERO_TO_FP32, *directories], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, DS_BUILD_OPS="0", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(d + ".fp32.pt") for d in directories]


class SharedWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer0 = torch.nn.Linear(10, 10)
        self.layer1 = torch.nn.Linear(20, 20)
        self.layer2 = torch.nn.Linear(30, 30)
        self.layer1.weight = self.layer2.weight  # tied


def _shared_weights_model() -> SharedWeights:
    torch.manual_seed(0)
    return SharedWeights()


def _save_shared_weights(rank, world, tmp):
    model = _shared_weights_model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2}}
    engine = deepspeed.initialize(config=cfg, model=model, optimizer=torch.optim.Adam(model.parameters()))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.compile()  # the test's compile_mode
    engine.save_checkpoint(tmp, tag="checkpoint")  # the model has no forward: saved as it is


def test_zero_to_fp32_reads_the_checkpoint(workers2, tmp_path) -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed's zero_to_fp32 is the reference reader; pip install 'deepspeed>=0.19,<0.20'")
    cases = [(1, "fp32"), (2, "bf16"), (3, "fp32"), (0, "bf16")]
    if ALL:
        cases += [(3, "bf16"), (2, "fp32"), (1, "bf16")]
    saved = []
    for stage, precision in cases:
        d = tmp_path / f"z{stage}{precision}"
        masters = workers2.run(_save_for_zero_to_fp32, str(d), stage, precision)[0]
        tag = (d / "latest").read_text()
        assert tag == "global_step2"
        files = sorted(os.listdir(d / tag))
        prefix = "bf16_" if stage == 0 else ""
        assert f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
        assert f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
        assert ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt") in files
        saved.append(masters)
    workers2.run(_save_shared_weights, str(tmp_path / "shared"))
    read = _zero_to_fp32([str(tmp_path / f"z{stage}{precision}") for stage, precision in cases]
                         + [str(tmp_path / "shared")])
    shared = read.pop()  # checkpoint/test_shared_weights.py: the tied name comes back, a strict load works
    model = SharedWeights()
    model.load_state_dict(shared, strict=True)
    assert torch.equal(model.layer1.weight, _shared_weights_model().layer2.weight)
    for (stage, precision), masters, fp32 in zip(cases, saved, read):
        assert set(fp32) == set(masters), (stage, precision)
        for name, value in masters.items():
            assert torch.equal(fp32[name], value), (stage, precision, name)


# -- DeepSpeed's ds_to_universal converts these checkpoints ---------------------------------------------

class OddLayers(torch.nn.Module):
    """Sizes that leave ZeRO padding and split parameters across the 2 partitions: weights 48 + 30 +
    40 = 118 (padded to 120, cut inside the second weight), biases 6 + 5 + 8 = 19."""

    def __init__(self):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, 6), torch.nn.Linear(6, 5),
                                            torch.nn.Linear(5, HIDDEN)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def _save_for_universal(rank, world, tmp, stage, precision):
    torch.manual_seed(0)
    model = OddLayers()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, precision),
                                           model_parameters=_weight_decay_groups(model))
    batches = _batches(3, rank, _dtype(precision))
    _train(engine, batches[:2])
    engine.save_checkpoint(tmp)
    state = _optimizer_state(engine)
    weights = _state(engine)
    for name, s in state.items():  # the fp32 masters: the plan optimizer's under bf16, the weights under fp32
        s.setdefault("master_param", weights[name])
    loss = _train(engine, batches[2:])
    return state, loss, _state(engine)


def _load_universal(rank, world, folder, stage, precision, parallelized_first, tp=False):
    """test_universal_checkpoint.py's load step: the converted folder into an engine of another ZeRO
    stage (checkpoint.load_universal), before its first forward or after it; with `tp`, tensor
    parallel over both ranks (data-parallel size 1, each rank given the whole global batch)."""
    torch.manual_seed(7)
    model = OddLayers()
    extra = {"train_micro_batch_size_per_gpu": 4, "nnscaler": {"plan": "tp"}} if tp else {}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_weight_decay_groups(model),
                                           config=_config(stage, precision, checkpoint={"load_universal": True},
                                                          **extra))
    batches = _batches(3, rank, _dtype(precision))
    if tp:  # the source's global batch: both ranks' micro-batches
        both = list(zip(*(_batches(3, r, _dtype(precision)) for r in range(world))))
        batches = [(torch.cat([x for x, _ in b]), torch.cat([y for _, y in b])) for b in both]
    if parallelized_first:
        _train(engine, [(x + 1, y) for x, y in batches[:1]])
    with pytest.raises(ValueError, match="Invalid for universal checkpoint: .*latest_universal does not exist"):
        engine.load_checkpoint(os.path.join(folder, "universal"))  # DeepSpeed's error: the folder is the tag
    path, _ = engine.load_checkpoint(folder)
    assert path == os.path.join(folder, "universal")
    with torch.no_grad():
        engine(*batches[0])  # parallelizes the model (before it, the state waits)
    state = _optimizer_state(engine)
    weights = _state(engine)
    for name, s in state.items():
        s.setdefault("master_param", weights[name])
    groups = [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]
    steps = engine.global_steps
    assert engine.parallel_module.plan.unit_size == (world if tp else 1)
    loss = _train(engine, batches[2:])
    return state, groups, steps, loss, _state(engine)


DS_TO_UNIVERSAL = """
import argparse, sys
from deepspeed.checkpoint import ds_to_universal
for folder in sys.argv[1:]:
    ds_to_universal.main(argparse.Namespace(input_folder=folder + "/global_step2", output_folder=folder + "/universal",
                         num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                         inject_missing_state=False))
"""


def _universal_tensor(path: str) -> torch.Tensor:
    t = torch.load(path, weights_only=False)
    return t["param"] if isinstance(t, dict) else t  # ZeRO-1/2 write {"param": ..., "cat_dim": 0}, ZeRO-3 the tensor


def _load_universal_refused(rank, world, folder):
    """ZeRO-0 fp32 steps a plain torch optimizer, which takes no whole state: refused by name; the
    weights alone load."""
    model = OddLayers()
    engine = deepspeed.initialize(model=model, config=_config(0, checkpoint={"load_universal": True}))[0]
    with pytest.raises(NotImplementedError, match="load_optimizer_states=False"):
        engine.load_checkpoint(folder)
    engine.load_checkpoint(folder, load_optimizer_states=False)
    return _state(engine)


def test_ds_to_universal_reads_the_checkpoint(workers2, tmp_path) -> None:
    """test_universal_checkpoint.py's conversion step: DeepSpeed's `ds_to_universal` turns this engine's
    checkpoint into a universal one whose per-parameter fp32 weights and Adam moments are ours, whole."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed's ds_to_universal is the reference converter; pip install 'deepspeed>=0.19,<0.20'")
    cases = [(2, "bf16"), (3, "fp32")]
    if ALL:
        cases += [(1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16"), (0, "bf16")]
    runs = [workers2.run(_save_for_universal, str(tmp_path / f"u{stage}{precision}"), stage, precision)[0]
            for stage, precision in cases]
    saved = [state for state, _, _ in runs]
    folders = [str(tmp_path / f"u{stage}{precision}") for stage, precision in cases]
    proc = subprocess.run([sys.executable, "-c", DS_TO_UNIVERSAL, *folders], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, DS_BUILD_OPS="0", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for (stage, precision), state, folder in zip(cases, saved, folders):
        zero = os.path.join(folder, "universal", "zero")
        assert set(state) == {n for n, _ in OddLayers().named_parameters()}
        for name, ours in state.items():
            for key, theirs in (("fp32", "master_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                got = _universal_tensor(os.path.join(zero, name, f"{key}.pt"))
                assert got.numel() == ours[theirs].numel(), (stage, precision, name, key)
                assert torch.equal(got.reshape(ours[theirs].shape), ours[theirs]), (stage, precision, name, key)
            if stage < 3:  # ZeRO-1/2 conversion keeps the step per parameter
                assert float(torch.load(os.path.join(zero, name, "step.pt"), weights_only=False)) == 2.0
        common = torch.load(os.path.join(zero, "optimizer_state.pt"), weights_only=False)
        assert [g["weight_decay"] for g in common["param_groups"]] == [0.1, 0.0]
        assert [g["lr"] for g in common["param_groups"]] == [0.01, 0.02]
    weights = workers2.run(_load_universal_refused, folders[1])[0]
    assert all(torch.equal(weights[n], s["master_param"]) for n, s in saved[1].items())
    # checkpoint.load_universal: each folder into another ZeRO stage, the state exactly, the next step alike
    loads = [(1, 1, False, True)]  # (case, ZeRO stage, parallelized before the load, tensor parallel)
    if ALL:
        loads += [(0, 3, False, False), (1, 1, True, True), (1, 1, True, False), (2, 2, False, False),
                  (3, 3, True, False), (4, 1, False, False), (5, 2, True, False), (0, 2, False, True),
                  (6, 1, False, False), (3, 0, True, False)]
    for i, stage, first, tp in loads:
        source, precision = cases[i]
        state, groups, steps, loss, after = workers2.run(_load_universal, folders[i], stage, precision, first, tp)[0]
        assert _same(state, saved[i]), (source, precision, stage, tp)
        assert groups == [(0.01, 0.1), (0.02, 0.0)] and steps == 2, (source, stage, tp)
        _, next_loss, next_weights = runs[i]
        tol = 1e-2 if precision == "bf16" else 1e-5
        if not tp:  # tensor parallel: the loss of the global batch, the source's is rank 0's
            assert abs(loss[0] - next_loss[0]) <= tol, (source, stage, loss, next_loss)
        for name, value in next_weights.items():
            assert torch.allclose(after[name], value, atol=tol, rtol=0), (source, stage, name)


DEEPSPEED_SAVE = """
import os, sys, torch
import deepspeed, deepspeed.ops
from deepspeed.utils import safe_get_full_fp32_param
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build: plain gloo collectives
sys.path.insert(0, sys.argv[1])
import test_deepspeed_conformance as t
out, stage, rank = sys.argv[2], int(sys.argv[3]), int(os.environ["RANK"])
torch.manual_seed(0)
model = t.OddLayers()
engine = deepspeed.initialize(model=model, config=t._config(stage), model_parameters=t._weight_decay_groups(model))[0]
batches = t._batches(3, rank)
t._train(engine, batches[:2])
engine.save_checkpoint(out)
masters = {n: safe_get_full_fp32_param(p).float().clone() for n, p in engine.module.named_parameters()}
loss = t._train(engine, batches[2:])
if rank == 0:
    torch.save({"masters": masters, "loss": loss,
                "after": {n: v.float().clone() for n, v in engine.module.state_dict().items()}}, out + ".pt")
"""


def test_load_universal_of_deepspeeds_own_checkpoint(workers2, tmp_path) -> None:
    """test_universal_checkpoint.py end to end with DeepSpeed on the saving side: real DeepSpeed 0.19
    trains and saves (2 gloo processes), its ds_to_universal converts (with --inject_missing_state,
    as DeepSpeed's own engine writes no universal_checkpoint_info), this engine loads the folder: the
    masters are DeepSpeed's, the next step's loss and weights are DeepSpeed's."""
    import importlib.util
    import socket
    import subprocess
    import sys

    if not ALL:
        pytest.skip("launches real DeepSpeed (about 30 s a stage); runs with NNS_TEST_ALL_PLANS=1")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed 0.19; pip install 'deepspeed>=0.19,<0.20'")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_BUILD_OPS="0", GLOO_SOCKET_IFNAME="lo")
    for stage in (1, 2, 3):
        folder = str(tmp_path / f"ds{stage}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        script = tmp_path / "deepspeed_save.py"
        script.write_text(DEEPSPEED_SAVE)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(port), str(script), os.path.dirname(__file__), folder, str(stage)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               folder + "/global_step2", "--output_folder", folder + "/universal",
                               "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        theirs = torch.load(folder + ".pt")
        state, groups, steps, loss, after = workers2.run(_load_universal, folder, stage, "fp32", False)[0]
        assert all(torch.equal(state[n]["master_param"], m) for n, m in theirs["masters"].items()), stage
        assert groups == [(0.01, 0.1), (0.02, 0.0)] and steps == 2, stage
        assert loss == theirs["loss"], stage
        assert all(torch.allclose(after[n], v, atol=1e-6, rtol=0) for n, v in theirs["after"].items()), stage


# -- the engine before its first forward ---------------------------------------------------------------

def _before_first_forward(rank, world, tmp):
    out = {}
    model = _model()
    taken = dict(model.named_parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(1))
    names = [n for n, _ in engine.named_parameters()]
    out["names"] = names == ["module." + n for n, _ in model.named_parameters()]  # the model is its `module`
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.compile()  # test_missing_latest's compile_mode; the engine runs as before
    out["missing_latest"] = engine.load_checkpoint(os.path.join(tmp, "nothing-here")) == (None, None)
    out["grad_norm"] = engine.get_global_grad_norm()
    engine.save_checkpoint(tmp)  # before any forward: the initial weights, no optimizer state yet
    initial = _state(engine)
    model = _model(seed=5)
    other, _, _, _ = deepspeed.initialize(model=model, config=_config(1))
    other.load_checkpoint(tmp)
    out["loaded_initial"] = _same(_state(other), initial)
    batches = _batches(2, rank)
    a, b = _train(engine, batches), _train(other, batches)
    out["same_training"] = a == b and _same(_state(engine), _state(other))
    out["taken_get_grads"] = all(p.grad is None for p in taken.values())  # zeroed after the step, as DeepSpeed's
    x, y = batches[0]
    engine.backward(engine(x, y))
    out["taken_grads_after_backward"] = all(p.grad is not None for p in taken.values())
    whole = _state(engine)
    out["taken_trained"] = all(torch.equal(p.detach().float(), whole[n]) for n, p in taken.items())
    # example_inputs= parallelizes at initialize
    model = _model()
    eager, _, _, _ = deepspeed.initialize(model=model, config=_config(2), example_inputs=batches[0])
    out["eager_built"] = eager.parallel_module is not None
    out["eager_losses"] = _train(eager, batches) == a
    return out


def test_engine_works_before_the_first_forward(workers2, tmp_path) -> None:
    for r in workers2.run(_before_first_forward, str(tmp_path / "early")):
        assert r["names"] and r["grad_norm"] is None and r["missing_latest"]
        assert r["loaded_initial"] and r["same_training"]
        assert r["taken_get_grads"] and r["taken_grads_after_backward"] and r["taken_trained"]
        assert r["eager_built"] and r["eager_losses"]


# -- several parameter groups, each with its own hyperparameters ----------------------------------------

def _param_groups(rank, world, stage, precision):
    dt = _dtype(precision)
    model = _model()
    reference = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, precision, gradient_clipping=0.0),
                                           model_parameters=_weight_decay_groups(model))
    groups = [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups]
    ref_opt = torch.optim.AdamW(_weight_decay_groups(reference), lr=0.01)
    losses, ref_losses = [], []
    import torch.distributed as dist

    for step in range(2):
        mine = _batches(1, rank + 10 * step, dt)
        everyone = [_batches(1, r + 10 * step, dt)[0] for r in range(world)]
        losses += _train(engine, mine)
        ref_opt.zero_grad()
        for x, y in everyone:
            (reference(x.float(), y) / world).backward()
        ref_opt.step()
        ref_losses.append(float(reference(mine[0][0].float(), mine[0][1])))
    dist.barrier()
    state = _state(engine)
    close = all(torch.allclose(state[n], p.detach(), rtol=0, atol=2e-2 if precision == "bf16" else 1e-6)
                for n, p in reference.named_parameters())
    return {"groups": groups, "close": close}


def test_several_param_groups_under_every_zero_stage_and_precision(workers2) -> None:
    cases = [(s, p) for s in (0, 1, 2, 3) for p in ("fp32", "bf16")] if ALL else [(0, "bf16"), (2, "fp32"),
                                                                                  (3, "bf16")]
    for stage, precision in cases:
        for r in workers2.run(_param_groups, stage, precision):
            assert r["groups"] == [(0.01, 0.1), (0.02, 0.0)], (stage, precision)
            assert r["close"], (stage, precision)


# -- test_no_sync_ctxt.py, checkpoint tag validation, bucket sizes: DeepSpeed's error types --------------

def _errors(rank, world, tmp):
    out = {}
    for stage, precision in [(s, p) for p in ("fp32", "bf16", "fp16") for s in (0, 1, 2, 3)]:
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, precision))
        x, y = _batches(1, rank, _dtype(precision))[0]
        try:
            with engine.no_sync():
                engine.backward(engine(x, y))
                try:
                    engine.step()
                    stepped = "stepped"
                except AssertionError as e:
                    stepped = str(e)
                try:
                    with engine.no_sync():
                        pass
                    nested = "allowed"
                except AssertionError as e:
                    nested = str(e)
            out[(stage, precision)] = ("ok", stepped, nested)
        except AssertionError as e:
            out[(stage, precision)] = ("assert", str(e))
    # TestCheckpointValidationTag: FAIL with per-rank tags asserts, WARN saves
    for mode in ("FAIL", "WARN", "IGNORE"):
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, config=_config(1, checkpoint={"tag_validation": mode}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.compile()  # the tests' compile_mode: the same checks after engine.compile()
        try:
            engine.save_checkpoint(os.path.join(tmp, mode), tag=f"tag-{rank}")
            out[mode] = "saved"
        except AssertionError:
            out[mode] = "assert"
    # TestZeroUnbalancedGradients flips requires_grad between steps: refused by name, never trained anyway
    model = _model()
    engine = deepspeed.initialize(model=model, config=_config(1))[0]
    _train(engine, _batches(1, rank))
    model.linears[0].weight.requires_grad = False
    try:
        engine(*_batches(1, rank)[0])
        out["flip"] = "ran"
    except RuntimeError as e:
        out["flip"] = str(e)
    # TestIncorectAllgatherBucketSize
    for size in (1000, 1001):
        model = _model()
        try:
            deepspeed.initialize(model=model, config=_config(2, zero_optimization={"stage": 2,
                                                                                    "allgather_bucket_size": size}))
            out[size] = "ok"
        except AssertionError as e:
            out[size] = str(e)
    # save_checkpoint without a directory: DeepSpeed's ValueError, before and after the first forward
    for trained in (False, True):
        engine = deepspeed.initialize(model=_model(), config=_config(1))[0]
        if trained:
            _train(engine, _batches(1, rank))
        for save_dir in (None, ""):
            try:
                engine.save_checkpoint(save_dir)
                out[("save_dir", trained, save_dir)] = "saved"
            except ValueError as e:
                out[("save_dir", trained, save_dir)] = str(e)
    return out


def test_deepspeeds_error_types(workers2, tmp_path) -> None:
    for r in workers2.run(_errors, str(tmp_path)):
        for precision in ("fp32", "bf16", "fp16"):
            for stage in (0, 1):  # no_sync allowed; step inside it and nesting it assert
                assert r[(stage, precision)][0] == "ok"
                assert "illegal to call Engine.step() inside no_sync" in r[(stage, precision)][1]
                assert "reentry is unsupported" in r[(stage, precision)][2]
            for stage in (2, 3):
                assert r[(stage, precision)][0] == "assert"
                assert "incompatible with gradient partitioning" in r[(stage, precision)][1]
        assert r["FAIL"] == "assert" and r["WARN"] == "saved" and r["IGNORE"] == "saved"
        assert "requires_grad of ['linears.0.weight'] changed" in r["flip"]
        assert r[1000] == "ok" and "allgather_bucket_size must be a multiple of nccl_start_alignment_factor" in r[1001]
        for trained in (False, True):
            assert r[("save_dir", trained, None)] == "save_dir must be a non-empty string, got None"
            assert r[("save_dir", trained, "")] == "save_dir must be a non-empty string, got ''"


def test_config_values_deepspeed_validates() -> None:
    base = {"train_batch_size": 2}
    with pytest.raises(DeepSpeedConfigError, match="invalid tag_validation value of FOO"):
        translate(dict(base, checkpoint={"tag_validation": "foo"}))
    for mode in ("Ignore", "warn", "FAIL"):
        assert translate(dict(base, checkpoint={"tag_validation": mode})).tag_validation == mode.upper()
    for zero, pattern in [({"allgather_bucket_size": -1}, "allgather_bucket_size must be >= 0"),
                          ({"reduce_bucket_size": 0}, "reduce_bucket_size must be > 0"),
                          ({"overlap_comm": "yes"}, "overlap_comm must be true or false"),
                          ({"sub_group_size": 1.5}, "sub_group_size must be an integer")]:
        with pytest.raises(DeepSpeedConfigError, match=pattern):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                translate(dict(base, zero_optimization=dict(stage=2, **zero)))
    # half_precision/test_loss_scale_validation.py: non-finite scales are refused
    for fp16, pattern in [({"loss_scale": float("inf")}, "fp16.loss_scale must be finite"),
                          ({"initial_scale_power": 2000}, "fp16.initial_scale_power must be an integer"),
                          ({"min_loss_scale": 0}, "fp16.min_loss_scale must be finite and > 0")]:
        with pytest.raises(ValueError, match=pattern):
            translate(dict(base, fp16=dict(enabled=True, **fp16)))
    # TestZeROPPLoadCheckpoint's ZeRO++ (hierarchical partitioning, quantized weights): refused by name
    for zero, pattern in [({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size > 1"),
                          ({"zero_quantized_weights": True}, "zero_quantized_weights=true is not supported"),
                          ({"zero_quantized_gradients": True}, "zero_quantized_gradients=true is not supported")]:
        with pytest.raises(DeepSpeedConfigError, match=pattern):
            translate(dict(base, zero_optimization=dict(stage=3, **zero)))
    with pytest.raises(NotImplementedError, match="grad_accum_dtype"):
        translate(dict(base, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = translate(dict(base, zero_optimization={"stage": 3, "pipeline_loading_checkpoint": True,
                                                    "reduce_bucket_size": 5e8}))
    assert s.zero_stage == 3


def test_hjson_and_base64_configs_are_read_as_deepspeed_reads_them(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text("{\n  # a comment\n  train_batch_size: 4\n  zero_optimization: {stage: 2,},\n}\n")
    cfg = load_config(str(path))
    assert cfg == {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    path.write_text('{"train_batch_size": 4, "train_batch_size": 8}')
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['train_batch_size'\]"):
        load_config(str(path))
    import base64

    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 2}).encode()).decode()
    assert load_config(encoded) == {"train_batch_size": 2}
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))


# -- test_lr_schedulers.py: a learning rate held as a one-element tensor --------------------------------

@pytest.mark.parametrize("name, params", [("WarmupLR", {"warmup_num_steps": 4}),
                                          ("WarmupDecayLR", {"warmup_num_steps": 2, "total_num_steps": 6}),
                                          ("WarmupCosineLR", {"warmup_num_steps": 2, "total_num_steps": 6})])
def test_schedulers_take_a_tensor_learning_rate(name, params) -> None:
    from nnscaler_plugins.adapters.deepspeed.schedulers import build_scheduler

    p = torch.nn.Parameter(torch.zeros(2))
    with_tensor = torch.optim.AdamW([p], lr=torch.tensor([0.01]))
    with_float = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    a, b = build_scheduler(name, dict(params), with_tensor), build_scheduler(name, dict(params), with_float)
    for _ in range(6):
        a.step()
        b.step()
        assert isinstance(with_tensor.param_groups[0]["lr"], torch.Tensor)
        assert float(with_tensor.param_groups[0]["lr"]) == pytest.approx(with_float.param_groups[0]["lr"])


# -- zero.Init / GatheredParameters (zero/test_zero_context.py) ------------------------------------------

def _zero_context(rank, world, tmp):
    out = {}
    with deepspeed.zero.Init(enabled=False):
        model = _model()
    out["init_disabled_real"] = not any(p.is_meta for p in model.parameters())
    with deepspeed.zero.Init():
        meta_model = SimpleModel()
    out["init_meta"] = all(p.is_meta for p in meta_model.parameters())
    # a model built under zero.Init() trains from the weights nns.init_weights gives in one process
    reference = SimpleModel()
    with deepspeed.zero.Init():
        meta_model = SimpleModel()
    meta_engine, _, _, _ = deepspeed.initialize(model=meta_model, config=_config(3))
    seed = torch.tensor([torch.initial_seed() & (2**63 - 1)])
    torch.distributed.broadcast(seed, 0)  # the engine agrees on rank 0's seed
    import nnscaler_plugins as nns

    nns.init_weights(reference.to("meta"), int(seed.item()))
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    with deepspeed.zero.Init():
        early = SimpleModel()
    early_engine, _, _, _ = deepspeed.initialize(model=early, config=_config(1))
    early_engine.save_checkpoint(os.path.join(tmp, "meta"))  # before any forward: the weights it will train from
    saved = torch.load(os.path.join(tmp, "meta", "global_step0", "mp_rank_00_model_states.pt"), weights_only=False)
    out["meta_saved_early"] = _same(saved["module"], initial)
    ref_engine, _, _, _ = deepspeed.initialize(model=reference, config=_config(3))
    batches = _batches(2, rank)
    out["meta_trains_as_reference"] = _train(meta_engine, batches) == _train(ref_engine, batches)
    out["meta_no_whole_model"] = all(p.numel() == 0 and hasattr(p, "ds_id")  # ZeRO-3 pieces only
                                     for p in meta_model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(3))
    _train(engine, _batches(1, rank))
    weight = model.linears[0].weight
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        out["gathered_current"] = torch.equal(weight.detach(), engine.module_state_dict()["linears.0.weight"])
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
    out["modified_everywhere"] = bool((engine.module_state_dict()["linears.0.weight"] == 0.5).all())
    # TestGatheredParametersAllRanksErrorOnModification: modifying with no modifier_rank is an error
    # under zero_optimization.enable_sanity_checks (given to zero.Init, or to the engine); a warning
    # without them (DeepSpeed drops the change silently)
    checked = _config(3, zero_optimization={"stage": 3, "enable_sanity_checks": True})
    with deepspeed.zero.Init(config_dict_or_path=checked):
        meta_model = SimpleModel()
    checked_engine = deepspeed.initialize(model=_model(), config=checked)[0]
    _train(checked_engine, _batches(1, rank))
    for params in ([meta_model.linears[0].weight, meta_model.linears[1].weight],
                   [checked_engine.module.linears[0].weight], [weight]):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    with torch.no_grad():
                        params[0].add_(0.0)
            out.setdefault("unannounced", []).append("warned: " + " ".join(str(w.message) for w in caught))
        except RuntimeError as e:
            out.setdefault("unannounced", []).append(str(e))
    # TestSerialContext.test_ext_param_getattr: a layer's weight also used outside the layer, ZeRO-3
    import types

    class ExtLinear(torch.nn.Module):
        def __init__(self, dim=16):
            super().__init__()
            self.dim = dim
            self.linear1 = torch.nn.Linear(dim, dim)
            self.linear2 = torch.nn.Linear(dim, dim)

        def forward(self, x):
            return torch.nn.functional.linear(self.linear2(self.linear1(x)), self.linear1.weight).sum()

    torch.manual_seed(0)
    net = ExtLinear()
    cfg = {"train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}, "bf16": {"enabled": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = deepspeed.initialize(args=types.SimpleNamespace(local_rank=0), model=net,
                                      model_parameters=net.parameters(), config=cfg)[0]
    with deepspeed.zero.GatheredParameters(net.linear1.weight):
        whole = net.linear1.weight.numel() == net.dim ** 2
    x = torch.rand(1, net.dim).to(torch.bfloat16)
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    out["ext_param"] = (whole, bool(torch.isfinite(loss)), engine.global_steps)
    return out


def test_zero_init_and_gathered_parameters(workers2, tmp_path) -> None:
    for r in workers2.run(_zero_context, str(tmp_path)):
        assert r["init_disabled_real"] and r["init_meta"]
        assert r["meta_trains_as_reference"] and r["meta_no_whole_model"] and r["meta_saved_early"]
        assert r["gathered_current"] and r["modified_everywhere"]
        checked_meta, checked_engine, plain = r["unannounced"]
        assert checked_meta.startswith("in-place modification of 1 parameter"), checked_meta
        assert checked_engine.startswith("in-place modification of 1 parameter"), checked_engine
        assert plain.startswith("warned: in-place modification of 1 parameter"), plain
        assert r["ext_param"] == (True, True, 1)


def test_zero_init_starts_the_process_group() -> None:
    """TestSerialContext.test_scattered_init_dist: zero.Init() in a process with no process group
    starts one, as DeepSpeed's does (in its own process: this one must stay without)."""
    import subprocess
    import sys

    code = ("import torch.distributed as dist\n"
            "from nnscaler_plugins.adapters import deepspeed\n"
            "assert not dist.is_initialized()\n"
            "with deepspeed.zero.Init():\n"
            "    assert dist.is_initialized()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# -- test_data.py: the loader DeepSpeed builds from training_data, the last shorter batch ----------------

def _data(rank, world):
    data = torch.utils.data.TensorDataset(torch.randn(10, HIDDEN), torch.randint(0, HIDDEN, (10,)))
    out = {}
    for micro, drop_last in ((2, False), (2, True), (1, False), (1, True)):  # TestDataLoaderDropLast
        model = _model()
        engine, _, loader, _ = deepspeed.initialize(model=model, config=_config(0, dataloader_drop_last=drop_last,
                                                                                train_micro_batch_size_per_gpu=micro),
                                                    training_data=data)
        sizes = []
        for x, y in loader:
            sizes.append(len(x))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        out[(micro, drop_last)] = (sizes, engine.global_steps, engine.parallel_module is not None)
    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])  # test_repeating_loader
    out["repeating"] = [next(loader) for _ in range(7)]
    return out


def test_training_data_loader_and_last_shorter_batch(workers2) -> None:
    for r in workers2.run(_data):
        assert r[(2, False)] == ([2, 2, 1], 3, True)  # 5 samples per rank: the last batch has 1
        assert r[(2, True)] == ([2, 2], 2, True)
        assert r[(1, False)] == r[(1, True)] == ([1] * 5, 5, True)
        assert r["repeating"] == [1, 2, 3, 1, 2, 3, 1]


# -- checkpoint/test_zero_optimizer.py: frozen weights, immediate save/load, save mid-accumulation ------

class FrozenModel(SimpleModel):
    """DeepSpeed's SimpleFrozenModel: the first layer's weight does not train."""

    def __init__(self):
        super().__init__()
        self.linears[0].weight.requires_grad = False


def _frozen(rank, world, tmp, stage, how):
    torch.manual_seed(0)
    model = FrozenModel()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage), model_parameters=model.parameters())
    _train(engine, _batches(2, rank))
    engine.save_checkpoint(tmp, exclude_frozen_parameters=how == "exclude_frozen")
    torch.manual_seed(0)  # the same frozen weight: it is not in an exclude_frozen checkpoint
    other = FrozenModel()
    loaded, _, _, _ = deepspeed.initialize(model=other, config=_config(stage), model_parameters=other.parameters())
    loaded.load_checkpoint(tmp, load_optimizer_states=how != "no_optimizer", load_module_only=how == "module_only")
    saved = torch.load(os.path.join(tmp, "global_step2", "mp_rank_00_model_states.pt" if stage < 3 else
                                    "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False)["module"]
    out = {"module": _same(_state(engine), _state(loaded)), "saved_keys": sorted(saved)}
    more = _batches(1, rank + 3)
    out["next_equal"] = _train(engine, more) == _train(loaded, more) and _same(_state(engine), _state(loaded))
    return out


def _custom_state_dict_saved(rank, world, tmp, stage):
    """test_save_exclude_custom_frozen_weights: a model whose state_dict the script replaced."""
    torch.manual_seed(0)
    model = FrozenModel()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))[0]
    _train(engine, _batches(1, rank))
    own = model.state_dict
    model.state_dict = lambda *a, **k: {n: v for n, v in own(*a, **k).items() if n != "linears.1.bias"}
    engine.save_checkpoint(tmp, exclude_frozen_parameters=True)
    model.state_dict = own
    saved = torch.load(os.path.join(tmp, "global_step1", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    return sorted(saved)


def test_frozen_weights_round_trip(workers2, tmp_path) -> None:
    for stage in (1, 2):  # the replaced state_dict's entries that train, nothing else
        for r in workers2.run(_custom_state_dict_saved, str(tmp_path / f"custom{stage}"), stage):
            assert r == ["linears.0.bias", "linears.1.weight"], stage
    cases = [(1, "full"), (3, "no_optimizer"), (2, "module_only"), (2, "exclude_frozen")]
    if ALL:
        cases = [(s, h) for s in (1, 2, 3) for h in ("full", "no_optimizer", "module_only", "exclude_frozen")]
    every = ["linears.0.bias", "linears.0.weight", "linears.1.bias", "linears.1.weight"]
    for i, (stage, how) in enumerate(cases):
        for r in workers2.run(_frozen, str(tmp_path / f"f{i}"), stage, how):
            assert r["module"], (stage, how)
            if how == "exclude_frozen":
                assert r["saved_keys"] == [k for k in every if k != "linears.0.weight"]
            else:
                assert r["saved_keys"] == every
            if how in ("full", "exclude_frozen"):
                assert r["next_equal"], (stage, how)


def _edge_cases(rank, world, tmp, stage):
    out = {}
    cfg = _config(stage, "bf16")
    # test_immediate_save_load: save and load on the same engine before any step
    model = _model()
    # (the model's values as the engine holds them: in bf16; under ZeRO-3 the model's own parameters
    # hold none once initialize partitions them, as DeepSpeed's)
    initial = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    engine.save_checkpoint(os.path.join(tmp, "a"))
    engine.load_checkpoint(os.path.join(tmp, "a"), load_optimizer_states=False, load_lr_scheduler_states=False)
    out["immediate"] = _same(_state(engine), initial)
    # test_load_immediate_save: train, save; a fresh engine on the same model loads and saves at once
    _train(engine, _batches(1, rank, torch.bfloat16))
    engine.save_checkpoint(os.path.join(tmp, "b"))
    fresh, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    fresh.load_checkpoint(os.path.join(tmp, "b"), load_optimizer_states=False, load_lr_scheduler_states=False)
    fresh.save_checkpoint(os.path.join(tmp, "b"))
    out["load_immediate_save"] = _same(_state(engine), _state(fresh))
    # test_save_before_accum_grad_is_done: one micro-step of two, then save_16bit_model and a checkpoint
    acc = _config(stage, "bf16", gradient_accumulation_steps=2)
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=acc)
    x, y = _batches(1, rank, torch.bfloat16)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.empty_partition_cache()
    engine.save_16bit_model(os.path.join(tmp, "c"), "model.pt")
    engine.save_checkpoint(os.path.join(tmp, "c"))
    saved = torch.load(os.path.join(tmp, "c", "model.pt"))
    out["mid_accumulation"] = (engine.global_steps, all(v.dtype == torch.bfloat16 for v in saved.values()))
    return out


def test_save_and_load_edge_cases(workers2, tmp_path) -> None:
    for stage in ((0, 1, 2, 3) if ALL else (1, 3)):
        for r in workers2.run(_edge_cases, str(tmp_path / f"s{stage}"), stage):
            assert r["immediate"] and r["load_immediate_save"], stage
            assert r["mid_accumulation"] == (0, True), stage


# -- test_no_sync_ctxt.py test_multiple_ctxts: the same losses and gradients in two no_sync blocks -------

def _multiple_ctxts(rank, world, stage, precision):
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, precision))
    params = list(engine.parameters())
    batches = _batches(3, rank, _dtype(precision))
    runs = []
    for _ in range(2):
        engine.zero_grad()
        losses, norms = [], []
        with engine.no_sync():
            for x, y in batches:
                loss = engine(x, y)
                losses.append(loss.item())
                engine.backward(loss)
                norms.append(sum(deepspeed.utils.safe_get_full_grad(p).float().norm() for p in params).item())
        runs.append((losses, norms))
    return runs


def test_no_sync_blocks_repeat(workers2) -> None:
    for stage in (0, 1):
        for precision in ("fp32", "bf16", "fp16"):
            for first, second in workers2.run(_multiple_ctxts, stage, precision):
                assert first == second, (stage, precision)


# -- offload (test_ds_initialize TestNoOptim, checkpoint tests with cpu_offload) --------------------------

def _offload(rank, world, tmp):
    batches = _batches(3, rank)
    out = {}
    plain = deepspeed.initialize(model=_model(), config=_config(3))[0]
    reference = _train(plain, batches)
    for name, zero in [("optimizer", {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
                       ("cpu_offload", {"stage": 2, "cpu_offload": True}),
                       ("params", {"stage": 3, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu"}})]:
        engine = deepspeed.initialize(model=_model(), config=_config(zero_optimization=zero))[0]
        losses = _train(engine, batches)
        out[name] = (engine.parallel_module.plan.offload, losses == reference)
    engine.save_checkpoint(tmp)
    loaded = deepspeed.initialize(model=_model(seed=3), config=_config(3))[0]  # without offload
    loaded.load_checkpoint(tmp)
    more = _batches(1, rank + 5)
    out["loads_without_offload"] = _train(engine, more) == _train(loaded, more)
    return out


def test_offload_trains_as_without(workers2, tmp_path) -> None:
    for r in workers2.run(_offload, str(tmp_path)):
        assert r["optimizer"] == ("optimizer", True) and r["cpu_offload"] == ("optimizer", True)
        assert r["params"] == ("params", True) and r["loads_without_offload"]


def test_offload_config() -> None:
    base = {"train_batch_size": 2}
    with pytest.raises(DeepSpeedConfigError, match="offload_param.device='nvme': NVMe offload is not supported"):
        translate(dict(base, zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}))
    with pytest.raises(DeepSpeedConfigError, match=r"offload_optimizer.buffer_size"):
        translate(dict(base, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_size": 1}}))
    with pytest.warns(UserWarning, match="offload_param has effect only under ZeRO stage 3"):
        s = translate(dict(base, zero_optimization={"stage": 0, "offload_param": {"device": "cpu"}}))
    assert s.offload is None
    assert translate(dict(base, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})).offload \
        == "optimizer"


# -- the project's resharding load under DeepSpeed's layout: saved data parallel, loaded tensor parallel --

def _reshard(rank, world, tmp):
    full = _batches(2, 0, batch=4)  # tensor-parallel ranks see the same batch: give both the whole one
    model = _model()
    dp = deepspeed.initialize(model=model, config=_config(2, train_micro_batch_size_per_gpu=2))[0]
    _train(dp, [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in full])
    dp.save_checkpoint(tmp)
    tp = deepspeed.initialize(model=_model(seed=4), config=_config(0, train_micro_batch_size_per_gpu=4,
                                                                   nnscaler={"plan": "tp"}))[0]
    tp.load_checkpoint(tmp)
    more = _batches(1, 9, batch=4)[0]
    a = _train(dp, [(more[0][2 * rank:2 * rank + 2], more[1][2 * rank:2 * rank + 2])])
    b = _train(tp, [more])
    import torch.distributed as dist

    mine = torch.tensor(a)
    dist.all_reduce(mine)
    return {"module": _same(_state(dp), _state(tp)) or all(torch.allclose(v, _state(tp)[k], atol=1e-6)
                                                         for k, v in _state(dp).items()),
            "loss": (mine.item() / world, b[0]), "tp_pieces": tp.parallel_module.plan.unit_size}


def test_checkpoint_loads_under_another_plan(workers2, tmp_path) -> None:
    for r in workers2.run(_reshard, str(tmp_path)):
        assert r["tp_pieces"] == 2 and r["module"]
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5)


# -- test_ds_config_dict.py -----------------------------------------------------------------------------

@pytest.mark.parametrize("batch, micro, gas, ok", [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False),
                                                   (32, 18, 1, False)])
def test_batch_config(batch, micro, gas, ok) -> None:
    """TestBatchConfig (2 ranks): any two of the triple, or all three, give the same result;
    an inconsistent triple is an AssertionError, as DeepSpeed's."""
    from nnscaler_plugins.adapters.deepspeed.config import resolve_batch

    def run(**given):
        s = translate({k: v for k, v in {"train_batch_size": given.get("train"),
                                         "train_micro_batch_size_per_gpu": given.get("micro"),
                                         "gradient_accumulation_steps": given.get("gas")}.items() if v is not None})
        try:
            resolve_batch(s, 2)
        except AssertionError:
            return None
        return s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps

    expected = (batch, micro, gas) if ok else None
    assert run(train=batch, micro=micro, gas=gas) == expected
    assert run(train=batch, micro=micro) == expected
    if ok:
        assert run(train=batch, gas=gas) == expected and run(micro=micro, gas=gas) == expected
        if gas == 1:
            assert run(micro=micro) == expected and run(train=batch) == expected
    else:
        assert run(gas=gas) is None
        if gas != 1:
            assert run(train=batch, gas=gas) is None


def _config_loading(rank, world, tmp):
    import argparse

    import hjson

    base = {"train_batch_size": world, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "bf16": {"enabled": True}}
    out = {}
    # TestConfigLoad: dict, JSON file, hjson file
    path = os.path.join(tmp, f"config{rank}.json")
    with open(path, "w") as f:
        json.dump(base, f)
    hpath = os.path.join(tmp, f"config{rank}.hjson")
    with open(hpath, "w") as f:
        hjson.dump(base, f)
    for name, cfg in (("dict", base), ("json", path), ("hjson", hpath)):
        model = _model()
        engine = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())[0]
        out[name] = engine.bfloat16_enabled() and engine.train_batch_size() == world
    # TestDeprecatedDeepScaleConfig and TestDistInit: then train
    args = argparse.ArgumentParser().parse_args(args="")
    args.deepscale_config, args.local_rank = path, 0
    model = _model()
    engine = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                  dist_init_required=True)[0]
    out["deepscale"] = len(_train(engine, _batches(2, rank, torch.bfloat16, batch=1))) == 2
    # TestArgs: args=None, and no args
    for kwargs in ({"args": None}, {}):
        model = _model()
        engine = deepspeed.initialize(model=model, config=base, **kwargs)[0]
        x, y = _batches(1, rank, torch.bfloat16, batch=1)[0]
        out.setdefault("args", []).append(bool(torch.isfinite(engine(x, y))))
    # TestInitNoOptimizer: backward and step assert without an optimizer
    no_opt = {k: v for k, v in base.items() if k not in ("optimizer", "bf16")}
    engine = deepspeed.initialize(config=no_opt, model=_model())[0]
    x, y = _batches(1, rank, batch=1)[0]
    loss = engine(x, y)
    asserted = []
    for call in (lambda: engine.backward(loss), engine.step):
        try:
            call()
            asserted.append(False)
        except AssertionError as e:
            asserted.append("must provide optimizer" in str(e))
    out["no_optimizer"] = asserted
    # TestNoModel: model=None, or the model passed where args go
    refused = []
    for call in (lambda: deepspeed.initialize(model=None, config=base),
                 lambda: deepspeed.initialize(_model(), config=base)):
        try:
            call()
            refused.append(False)
        except AssertionError:
            refused.append(True)
    out["no_model"] = refused
    return out


def test_config_loading_and_initialize_arguments(workers2, tmp_path) -> None:
    for r in workers2.run(_config_loading, str(tmp_path)):
        assert r["dict"] and r["json"] and r["hjson"]
        assert r["deepscale"] and r["args"] == [True, True]
        assert r["no_optimizer"] == [True, True] and r["no_model"] == [True, True]


# -- test_lr_schedulers.py through the engine: lr before training, scheduler/optimizer parity, warmup ends -

SCHEDULES = [("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": 4,
                           "warmup_type": "log"}),
             ("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": 4,
                           "warmup_type": "linear"}),
             ("WarmupDecayLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": 4,
                                "total_num_steps": 8}),
             ("WarmupCosineLR", {"warmup_num_steps": 4, "total_num_steps": 8}),
             ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                           "decay_step_size": 3, "decay_lr_rate": 0.001}),
             ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2,
                              "lr_range_test_staircase": True})]


def _schedules(rank, world):
    out = []
    for name, params in SCHEDULES:
        cfg = _config(1, gradient_clipping=1.0, scheduler={"type": name, "params": params})
        cfg["optimizer"]["params"]["lr"] = 0.00015
        engine, _, _, sched = deepspeed.initialize(model=_model(), config=cfg)
        before = [g["lr"] for g in engine.optimizer.param_groups] == sched.get_lr()
        lrs, parity = [], True
        for x, y in _batches(9, rank):
            lrs.append(sched.get_lr()[0])
            engine.backward(engine(x, y))
            engine.step()
            parity &= sched.get_lr() == engine.get_lr()
        out.append((before, parity, lrs))
    return out


def test_schedules_through_the_engine(workers2) -> None:
    for r in workers2.run(_schedules):
        for (name, params), (before, parity, lrs) in zip(SCHEDULES, r):
            assert before and parity, name
            if name in ("WarmupLR", "WarmupDecayLR"):
                # lrs[i] is read before step i; DeepSpeed's test reads after: its step_lrs[n] is lrs[n + 1]
                assert lrs[0] == lrs[1] == params["warmup_min_lr"]
                assert lrs[5] == pytest.approx(params["warmup_max_lr"])
                later = lrs[5:]
                assert all(b < a for a, b in zip(later, later[1:])) if name == "WarmupDecayLR" else \
                    all(v == pytest.approx(0.2) for v in later)
            if name == "OneCycle":
                assert lrs[0] == 0.001 and lrs[3] == pytest.approx(0.1)
                assert all(a < b for a, b in zip(lrs[:3], lrs[1:4]))
                assert all(a > b for a, b in zip(lrs[3:6], lrs[4:7]))
            if name == "LRRangeTest":
                assert lrs[0] == 1e-4 and lrs[0] == lrs[1] and lrs[2] > lrs[1]


# -- zero/test_zero.py: TestZeroToFP32 (uneven sizes, frozen and unused parameters, two SGD groups) and
#    TestZero3RepeatForwardLoop (one layer run three times) ------------------------------------------------

class UnevenModel(torch.nn.Module):
    """TestZeroToFP32's model: 4 x 12 + 5 = 53 elements (odd), a classifier the forward never uses."""

    def __init__(self, freeze: bool):
        super().__init__()
        self.ll = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(4))
        self.classifier = torch.nn.Linear(4, 1)
        if freeze:
            self.ll[0].weight.requires_grad = False
            self.ll[0].bias.requires_grad = False

    def forward(self, x, y):
        for layer in self.ll:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def _uneven(rank, world, tmp, stage, freeze, groups):
    """test_2_param_groups: two SGD groups given as a client optimizer, fp32; test_1_param_group: the
    config's Adam over one group, bf16 (DeepSpeed's CPU runs take its bf16 branch)."""
    torch.manual_seed(0)
    model = UnevenModel(freeze)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if groups == 2:
        sgd_groups = [{"params": [m.weight for m in model.ll], "weight_decay": 0.01},
                      {"params": [m.bias for m in model.ll] + list(model.classifier.parameters()), "weight_decay": 0.0}]
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      optimizer=torch.optim.SGD(sgd_groups, lr=0.1))[0]
    else:
        cfg.update(optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, bf16={"enabled": True})
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    engine.empty_partition_cache()
    g = torch.Generator().manual_seed(rank)
    dt = torch.bfloat16 if groups == 1 else torch.float32
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 3, generator=g).to(dt), torch.randint(0, 3, (2,), generator=g)))
        engine.step()
    engine.empty_partition_cache()
    engine.save_checkpoint(tmp)
    return _state(engine)


def _repeat_forward(rank, world):
    class AlbertLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            hidden = x
            for _ in range(3):
                hidden = hidden + self.linear(hidden)
            return torch.nn.functional.cross_entropy(hidden, y)

    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = deepspeed.initialize(model=AlbertLike(), config=cfg)[0]
        g = torch.Generator().manual_seed(rank)
        losses[stage] = []
        for _ in range(4):
            loss = engine(torch.randn(2, 4, generator=g), torch.randint(0, 4, (2,), generator=g))
            engine.backward(loss)
            engine.step()
            losses[stage].append(loss.item())
    return losses


def test_zero_to_fp32_uneven_frozen_unused_and_repeated_layers(workers2, tmp_path) -> None:
    import importlib.util

    # (stage, freeze, param groups): TestZeroToFP32's test_2_param_groups and test_1_param_group
    cases = [(2, True, 2), (3, False, 2), (2, False, 1), (3, True, 1)]
    if ALL:
        cases = [(s, f, n) for s in (2, 3) for f in (True, False) for n in (1, 2)]
    states = [workers2.run(_uneven, str(tmp_path / f"u{s}{f}{n}"), s, f, n)[0] for s, f, n in cases]
    if importlib.util.find_spec("deepspeed") is not None:
        read = _zero_to_fp32([str(tmp_path / f"u{s}{f}{n}") for s, f, n in cases])
        for case, state, fp32 in zip(cases, states, read):
            assert set(fp32) == set(state), case
            for name, value in state.items():
                # load_state_dict_from_zero_checkpoint puts the fp32 masters into the bf16 model
                got = fp32[name].to(torch.bfloat16).float() if case[2] == 1 else fp32[name]
                assert torch.equal(got, value) if case[2] == 1 else torch.allclose(got, value), (case, name)
    for r in workers2.run(_repeat_forward):
        assert r[0] == pytest.approx(r[3], rel=1e-6)


# -- test_lr_schedulers.py's parameterizations with its own assertions (the engine steps the schedule
#    once per optimizer step, as test_schedules_through_the_engine checks) --------------------------------

def _lrs(name: str, params: dict, steps: int, before: bool) -> list:
    from nnscaler_plugins.adapters.deepspeed.schedulers import build_scheduler

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.00015)
    sched = build_scheduler(name, dict(params), opt)
    out = []
    for _ in range(steps):
        if before:
            out.extend(sched.get_lr())
        sched.step()
        if not before:
            out.append(sched.get_lr())
    return out


@pytest.mark.parametrize("warmup_num_steps", [10, 15, 19, 33])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_lr_warmup_and_warmup_decay_schedules(warmup_num_steps, warmup_type) -> None:
    params = {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": warmup_num_steps,
              "warmup_type": warmup_type}
    step_lrs = _lrs("WarmupLR", params, 2 * warmup_num_steps, before=False)
    assert step_lrs[0] == [0.1] and step_lrs[warmup_num_steps] == [0.2]
    assert all(lr == [0.2] for lr in step_lrs[warmup_num_steps:])
    step_lrs = _lrs("WarmupDecayLR", dict(params, total_num_steps=2 * warmup_num_steps), 2 * warmup_num_steps,
                    before=False)
    assert step_lrs[0] == [0.1] and step_lrs[warmup_num_steps] == [0.2]
    later = step_lrs[warmup_num_steps:]
    assert all(b < a for a, b in zip(later, later[1:]))


@pytest.mark.parametrize("min_lr, step_rate, step_size, staircase", [
    (1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True), (1e-3, 1e-3, 10, False),
    (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)])
def test_lr_range_test_schedule(min_lr, step_rate, step_size, staircase) -> None:
    lrs = _lrs("LRRangeTest", {"lr_range_test_min_lr": min_lr, "lr_range_test_step_rate": step_rate,
                               "lr_range_test_step_size": step_size, "lr_range_test_staircase": staircase},
               max(50, step_size * 2), before=True)
    assert lrs[0] == min_lr
    if staircase:
        for i in range(0, len(lrs), step_size):
            assert all(v == lrs[i] for v in lrs[i:i + step_size])
    else:
        assert all(a < b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("min_lr, max_lr, decay_rate, cycle_step_size, decay_step_size", [
    (1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 0, 21, 21), (1e-5, 1e-2, 1e-3, 10, 10), (1e-3, 1e-1, 1e-1, 21, 21),
    (1e-5, 1e-1, 0, 10, 0)])
def test_one_cycle_schedule(min_lr, max_lr, decay_rate, cycle_step_size, decay_step_size) -> None:
    lrs = _lrs("OneCycle", {"cycle_min_lr": min_lr, "cycle_max_lr": max_lr, "decay_lr_rate": decay_rate,
                            "cycle_first_step_size": cycle_step_size, "decay_step_size": decay_step_size},
               max(50, cycle_step_size * 3), before=True)
    assert lrs[0] == min_lr and lrs[cycle_step_size] == pytest.approx(max_lr, rel=1e-12)
    assert all(a < b for a, b in zip(lrs[:cycle_step_size], lrs[1:cycle_step_size]))
    down = lrs[cycle_step_size:2 * cycle_step_size]
    assert all(a > b for a, b in zip(down, down[1:]))
    if decay_rate > 0:
        decay = lrs[2 * cycle_step_size:]
        assert all(a > b for a, b in zip(decay, decay[1:]))


# -- zero/test_zero.py: empty param groups, train/eval switching, frozen weights with tuple outputs,
#    ZeRO-1 offload, a client optimizer under offload, the client module's own attributes -------------

class TupleFrozenModel(torch.nn.Module):
    """TestZeroFrozenWeights' model: the second layer frozen, (output, loss) returned."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.l1 = torch.nn.Linear(hidden, hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.l2.weight.requires_grad = False
        self.l2.bias.requires_grad = False

    def forward(self, x, y):
        x = self.l2(torch.relu(self.l1(x)))
        return x, torch.nn.functional.cross_entropy(x, y)


def _zero_cases(rank, world):
    out = {}
    # TestEmptyParameterGroup: one of two groups empty, as a client optimizer or as model_parameters
    for precision in ("bf16", "fp32"):
        for client in (True, False):
            for empty_weights in (True, False):
                model = SimpleModel(hidden=4, nlayers=4)
                groups = [{"params": [] if empty_weights else [m.weight for m in model.linears], "weight_decay": 0.01},
                          {"params": [m.bias for m in model.linears] if empty_weights else [], "weight_decay": 0.0}]
                cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                       "fp16": {"enabled": False}, "bf16": {"enabled": precision == "bf16"}}
                if client:
                    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                             optimizer=torch.optim.AdamW(groups, lr=0.1), config=cfg)
                else:
                    cfg["optimizer"] = {"type": "adamw"}
                    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
                out[("empty_group", precision, client, empty_weights)] = [len(g["params"]) for g in opt.param_groups]
                if precision == "bf16" and client and empty_weights:
                    # the weights are in no group: DeepSpeed leaves them as they are; this engine refuses
                    # by name at the first forward to train them (it steps every parameter it trains)
                    x, y = _batches(1, rank, torch.bfloat16, batch=1)[0]
                    try:
                        engine(x[:, :4], y % 4)
                        out["no_group_refused"] = ""
                    except ValueError as e:
                        out["no_group_refused"] = str(e)
                engine.destroy()
    # TestZero3SwitchModes: train, then evaluate under no_grad, three times over, for 3 prefetch sizes
    for ratio in (0.0, 0.5, 1.0) if ALL else (0.5,):  # the prefetch size only tunes DeepSpeed's gathering
        model = _model()
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": int(
                   sum(p.numel() for p in model.parameters()) * ratio)},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        engine = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())[0]
        batches = _batches(4, rank, torch.bfloat16)
        evaluated = []
        for _ in range(3):
            engine.train()
            _train(engine, batches)
            engine.eval()
            state = _state(engine)
            with torch.no_grad():
                evaluated.append([engine(x, y).item() for x, y in batches])
            assert _same(state, _state(engine))  # evaluating changes nothing
        out[("switch", ratio)] = (engine.global_steps, all(torch.isfinite(torch.tensor(e)).all() for e in evaluated),
                                  evaluated[0] != evaluated[2])
    # TestZeroFrozenWeights: the frozen layer stays, the other trains; (output, loss) comes back whole
    for stage in (1, 2, 3) if ALL else (3,):
        cfg = {"train_batch_size": 2 * world, "steps_per_print": 1000, "bf16": {"enabled": True},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": stage}}
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=stage == 3):
            model = TupleFrozenModel()
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        before = None
        for x, y in _batches(3, rank, torch.bfloat16):
            if before is None:
                engine.parallelize((x, y))
                before = _state(engine)
            output, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        after = _state(engine)
        out[("frozen", stage)] = (output.shape == (2, HIDDEN),
                                  sorted(n for n in after if not torch.equal(after[n], before[n])))
    # TestZeroOffloadStage1, and TestZeroOffloadOptim: a client optimizer under offload_optimizer is
    # DeepSpeed's ZeRORuntimeException unless zero_force_ds_cpu_optimizer is false
    cfg = {"train_batch_size": 2 * world, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    engine = deepspeed.initialize(model=_model(), config=cfg)[0]
    out["offload_stage1"] = (engine.parallel_module.plan.offload if _train(engine, _batches(4, rank, torch.bfloat16))
                             else None, engine.global_steps)
    for force in (True, False):
        model = _model()
        cfg = {"train_batch_size": 2 * world, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
               "bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": force,
               "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
        try:
            deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
            out[("force_ds_cpu_optimizer", force)] = "initialized"
        except deepspeed.ZeRORuntimeException as e:
            out[("force_ds_cpu_optimizer", force)] = str(e)
    # TestZero3ClientModuleID: the model's own attributes are the engine's and stay as they were

    class WithId(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.id = 3
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x)

    model = WithId()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"},
                                          "zero_optimization": {"stage": 3}})[0]
    out["module_id"] = (model.id, engine.id)
    return out


def test_zero_engine_cases_follow_test_zero(workers2) -> None:
    for r in workers2.run(_zero_cases):
        for precision in ("bf16", "fp32"):
            for client in (True, False):
                for empty_weights in (True, False):
                    assert r[("empty_group", precision, client, empty_weights)] == [4]  # the empty one dropped
        assert "in no param group of the optimizer: ['linears.0.weight'" in r["no_group_refused"]
        for ratio in (0.0, 0.5, 1.0) if ALL else (0.5,):
            assert r[("switch", ratio)] == (6, True, True), ratio
        for stage in (1, 2, 3) if ALL else (3,):
            assert r[("frozen", stage)] == (True, ["l1.bias", "l1.weight"]), stage
        assert r["offload_stage1"] == ("optimizer", 2)
        assert "zero_force_ds_cpu_optimizer" in r[("force_ds_cpu_optimizer", True)]
        assert r[("force_ds_cpu_optimizer", False)] == "initialized"
        assert r["module_id"] == (3, 3)


# -- checkpoint/test_zero_optimizer.py TestSaveTensorClone -----------------------------------------------

def _save_tensor_clone(rank, world, tmp, stage, device):
    from nnscaler_plugins.adapters.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    model = SimpleModel(hidden=64, nlayers=4).half()
    reference = model.state_dict()
    cfg = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}, "train_batch_size": world,
           "train_micro_batch_size_per_gpu": 1}
    engine = deepspeed.initialize(model=model, config_params=cfg)[0]
    cloned = clone_tensors_for_torch_save(engine.module.state_dict(), device=device)
    same = _same(reference, cloned) and all(v.data_ptr() != reference[k].data_ptr() for k, v in cloned.items())
    torch.save(reference, os.path.join(tmp, f"ref{rank}.pt"))
    torch.save(cloned, os.path.join(tmp, f"clone{rank}.pt"))
    saved_same = _same(torch.load(os.path.join(tmp, f"ref{rank}.pt")), torch.load(os.path.join(tmp, f"clone{rank}.pt")))
    # a view's clone saves only what it holds
    nested = clone_tensors_for_torch_save({"a": [torch.arange(10.0)[2:4]], "b": (torch.ones(1), 7)})
    return same, saved_same, nested["a"][0].untyped_storage().nbytes(), nested["b"][1]


def test_save_tensor_clone(workers2, tmp_path) -> None:
    for stage in (1, 2):
        for device in ("cpu", torch.device("cpu")):
            for r in workers2.run(_save_tensor_clone, str(tmp_path), stage, device):
                assert r == (True, True, 8, 7), (stage, device)


# -- test_ds_initialize.py TestOptimizerImplementation: ZeRO 0-3 x model dtype x grad_accum_dtype ----------

# DeepSpeed's table of the combinations it runs (for the dtypes its CPU runs: bf16 and fp32; fp16
# and the apex "amp" wrapper are skipped there). The rest raise NotImplementedError.
DEEPSPEED_SUPPORTED = ({(z, m, g) for z in ("zero1", "zero2", "zero3") for m in ("bf16", "fp32")
                        for g in (None, "bf16", "fp32")}
                       | {(None, "bf16", None), (None, "bf16", "bf16"), (None, "fp32", None), (None, "fp32", "fp32")})


def _implementations(rank, world):
    out = {}
    for extension in ("zero1", "zero2", "zero3", None):
        for model_dtype in ("bf16", "fp32"):
            for grad_accum_dtype in (None, "bf16", "fp32"):
                cfg = {"train_batch_size": world, "bf16": {"enabled": model_dtype == "bf16"},
                       "zero_optimization": {"stage": int(extension[-1]) if extension else 0},
                       "data_types": {"grad_accum_dtype": grad_accum_dtype},
                       "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
                model = _model()
                try:
                    deepspeed.initialize(config=cfg, model=model, model_parameters=list(model.parameters()))
                    out[(extension, model_dtype, grad_accum_dtype)] = "ok"
                except NotImplementedError as e:
                    out[(extension, model_dtype, grad_accum_dtype)] = str(e)
    return out


def test_optimizer_implementations_and_grad_accum_dtype(workers2) -> None:
    for r in workers2.run(_implementations):
        for key, got in r.items():
            if key[2] is None or key[2] == key[1]:  # gradients accumulate in the model's dtype: runs
                assert got == "ok" and key in DEEPSPEED_SUPPORTED, key
            else:  # refused as DeepSpeed refuses what it does not run, naming the dtypes
                assert "grad_accum_dtype" in got and key[1] in got, key


# -- test_lr_schedulers.py: TestOneCycle.test_mom and TestWarmupCosineLR, with their assertions ---------

@pytest.mark.parametrize("min_mom, max_mom, decay_rate, step_size", [
    (0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21), (0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21)])
def test_one_cycle_momentum(min_mom, max_mom, decay_rate, step_size) -> None:
    from nnscaler_plugins.adapters.deepspeed.schedulers import build_scheduler

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.00015)
    sched = build_scheduler("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": min_mom,
                                         "cycle_max_mom": max_mom, "decay_mom_rate": decay_rate,
                                         "cycle_first_step_size": step_size, "decay_step_size": step_size}, opt)
    moms = []
    for _ in range(max(50, step_size * 3)):
        moms.append(sched.get_mom()[0][0])
        sched.step()
    assert moms[0] == max_mom and moms[step_size] == min_mom
    assert all(a > b for a, b in zip(moms[:step_size], moms[1:step_size]))
    up = moms[step_size:2 * step_size]
    assert all(a < b for a, b in zip(up, up[1:]))
    if decay_rate > 0:
        decay = moms[2 * step_size:]
        assert all(a < b for a, b in zip(decay, decay[1:]))


@pytest.mark.parametrize("total_num_steps, warmup_num_steps, cos_min_ratio, warmup_min_ratio", [
    (100, 10, 0.1, 0.2), (200, 20, 0.1, 0.2), (500, 30, 0.0, 0.2), (600, 300, 0.1, 0.0), (600, 550, 0.0, 0.0)])
def test_warmup_cosine_schedule(total_num_steps, warmup_num_steps, cos_min_ratio, warmup_min_ratio) -> None:
    opt_lr = 0.0015
    from nnscaler_plugins.adapters.deepspeed.schedulers import build_scheduler

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=opt_lr)
    sched = build_scheduler("WarmupCosineLR", {"total_num_steps": total_num_steps, "warmup_min_ratio": warmup_min_ratio,
                                               "warmup_num_steps": warmup_num_steps, "cos_min_ratio": cos_min_ratio}, opt)
    lrs = []
    for _ in range(max(50, total_num_steps * 3)):
        sched.step()
        lrs.extend(sched.get_lr())
    assert abs(lrs[0] - opt_lr * warmup_min_ratio) < 1e-7
    assert abs(lrs[warmup_num_steps - 1] - opt_lr) < 1e-7
    assert abs(lrs[total_num_steps - 1] - opt_lr * cos_min_ratio) < 1e-7
    assert all(a < b for a, b in zip(lrs[:warmup_num_steps], lrs[1:warmup_num_steps]))
    down = lrs[warmup_num_steps:total_num_steps]
    assert all(a > b for a, b in zip(down, down[1:]))


# -- half_precision/test_zero_optim_overflow.py TestZeROBFloat16: gradients set whole with
#    safe_set_full_grad; bf16.check_grad_overflow skips the steps whose gradients are not finite --------

def _bf16_overflow(rank, world, stage, offload):
    out = {}
    for name, check, values in (("no_overflow", None, [0.05, -0.02, 0.1, -0.07]),
                                ("detect", True, [float("inf"), float("-inf"), float("nan"), float("nan")]),
                                ("ignore", False, [float("inf"), float("-inf"), float("nan"), float("nan")])):
        cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
               "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "torch_adam": True}},
               "bf16": {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check},
               "zero_optimization": {"stage": stage}}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine = deepspeed.initialize(model=_model(), config=cfg)[0]
        skipped = []
        for (x, y), value in zip(_batches(len(values), rank, torch.bfloat16, batch=1), values):
            engine.backward(engine(x, y))
            for p in engine.parameters():
                deepspeed.utils.safe_set_full_grad(p, torch.full(p.shape, value))
            if name == "no_overflow":  # what was set is what the next step reads
                got = deepspeed.utils.safe_get_full_grad(next(iter(engine.parameters()))) if stage < 2 else None
                out.setdefault("set_read_back", []).append(got is None or bool((got == value).all()))
            engine.step()
            skipped.append(engine.skipped_steps)
        finite = [bool(torch.isfinite(p.detach().float()).all()) for p in engine.parameters()]
        out[name] = (skipped, finite)
    return out


def test_bf16_overflow_checks_follow_test_zero_optim_overflow(workers2) -> None:
    cases = [(s, o) for s in (1, 2) for o in (False, True)] if ALL else [(1, False), (2, True)]
    for stage, offload in cases:
        for r in workers2.run(_bf16_overflow, stage, offload):
            assert r["no_overflow"] == ([0, 0, 0, 0], [True] * 4) and all(r["set_read_back"]), (stage, offload)
            assert r["detect"] == ([1, 2, 3, 4], [True] * 4), (stage, offload)  # skipped, weights untouched
            assert r["ignore"][0] == [0] * 4 and not any(r["ignore"][1]), (stage, offload)  # applied, as asked


# -- checkpoint/test_zero_optimizer.py test_hybrid_optimizer_state: a client optimizer whose state
#    holds a Python int beside a tensor -------------------------------------------------------------

class HybridStateOptimizer(torch.optim.Optimizer):
    """DeepSpeed's tests' optimizer: SGD that counts its steps in an int and in a tensor."""

    def __init__(self, params, lr=0.11072018):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["integer_step"] = 0
                    state["tensor_step"] = torch.zeros(1, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])
                state["integer_step"] += 1
                state["tensor_step"] += 1


def _hybrid_state(rank, world, tmp, stage):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    engines = []
    for seed in (0, 1):
        model = _model(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engines.append(deepspeed.initialize(config=cfg, model=model,
                                                optimizer=HybridStateOptimizer(model.parameters()))[0])
    trained, loaded = engines
    _train(trained, _batches(4, rank, torch.bfloat16))
    trained.save_checkpoint(tmp)
    loaded.load_checkpoint(tmp, load_optimizer_states=True)
    loaded.parallelize(_batches(1, rank, torch.bfloat16)[0])  # the optimizer state is the plan's from here
    states = []
    for engine in (trained, loaded):
        inner = engine.optimizer.inner
        full = inner.full_state_dict()["state"] if hasattr(inner, "full_state_dict") else inner.state
        states.append(sorted((n, s["integer_step"], float(s["tensor_step"].reshape(-1)[0])) for n, s in full.items()))
    more = _batches(2, rank + 9, torch.bfloat16)
    return states[0] == states[1], states[0][0][1:], _train(trained, more) == _train(loaded, more)


def test_hybrid_optimizer_state_round_trip(workers2, tmp_path) -> None:
    for stage in (1, 2):
        for r in workers2.run(_hybrid_state, str(tmp_path / f"h{stage}"), stage):
            assert r == (True, (2, 2.0), True), stage
