"""The DeepSpeed drop-in as DeepSpeed's own scripts use it: feature sections written switched off,
the module paths they import (`deepspeed.moe`, `deepspeed.pipe`, `deepspeed.compression`), and
what those objects compute against eager PyTorch / one process."""
from __future__ import annotations

import warnings

import pytest

from nnscaler_plugins.adapters.deepspeed.config import DeepSpeedConfigError, translate

BASE = {"train_batch_size": 4}

# What scripts write, switched off (DeepSpeed-Chat's get_train_ds_config, DeepSpeedExamples' configs).
SWITCHED_OFF = {
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}},
                             "sparse_pruning": {"shared_parameters": {"enabled": False}},
                             "layer_reduction": {"enabled": False}},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1},
    "wandb": {"enabled": False, "project": "p"},
    "tensorboard": {"enabled": False, "output_path": "logs", "job_name": "j"},
    "csv_monitor": {"enabled": False, "output_path": "logs", "job_name": "j"},
    "comms_logger": {"enabled": False, "verbose": False},
    "autotuning": {"enabled": False, "fast": True},
}


def test_feature_sections_switched_off_are_accepted_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: a switched-off section asks for nothing
        s = translate(dict(BASE, **SWITCHED_OFF))
    assert s.train_batch_size == 4
    for name in SWITCHED_OFF:  # an empty section is off too (DeepSpeed's default enabled is false)
        translate(dict(BASE, **{name: {}}))


@pytest.mark.parametrize("name,switch_on,instead", [
    ("hybrid_engine", lambda s: s.update(enabled=True), "engine.eval()"),
    ("compression_training", lambda s: s["sparse_pruning"]["shared_parameters"].update(enabled=True), "torch.ao"),
    ("flops_profiler", lambda s: s.update(enabled=True), "torch.profiler"),
    ("wandb", lambda s: s.update(enabled=True), "engine.get_lr()"),
    ("tensorboard", lambda s: s.update(enabled=True), "SummaryWriter"),
    ("csv_monitor", lambda s: s.update(enabled=True), "engine.get_lr()"),
    ("comms_logger", lambda s: s.update(enabled=True), "simulate"),
    ("autotuning", lambda s: s.update(enabled=True), "'plan': 'auto'"),
])
def test_feature_sections_switched_on_are_refused_by_name(name, switch_on, instead) -> None:
    import copy

    section = copy.deepcopy(SWITCHED_OFF[name])
    switch_on(section)
    with pytest.raises(DeepSpeedConfigError) as e:
        translate(dict(BASE, **{name: section}))
    assert name in str(e.value) and instead in str(e.value), str(e.value)


def test_feature_section_enabled_must_be_a_flag() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"tensorboard.enabled='false': must be true or false"):
        translate(dict(BASE, tensorboard={"enabled": "false"}))
    with pytest.raises(DeepSpeedConfigError, match=r"'wandb' must be an object"):
        translate(dict(BASE, wandb=True))


# -- the module paths DeepSpeed's scripts import ----------------------------------------------------
IMPORTS = """
import sys
from nnscaler_plugins.adapters import deepspeed
from nnscaler_plugins.adapters.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from nnscaler_plugins.adapters.deepspeed.moe.layer import MoE
from nnscaler_plugins.adapters.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
from nnscaler_plugins.adapters.deepspeed.runtime.pipe.module import PipelineModule as P2
from nnscaler_plugins.adapters.deepspeed.compression.helper import recursive_getattr, recursive_setattr
from nnscaler_plugins.adapters.deepspeed.utils.module_utils import recursive_getattr as g2
assert PipelineModule is P2 and recursive_getattr is g2
assert deepspeed.moe.layer.MoE is MoE and deepspeed.pipe.LayerSpec is LayerSpec
assert "deepspeed" not in sys.modules
"""


def test_import_paths_resolve_without_importing_deepspeed() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_signatures_are_deepspeeds() -> None:
    import inspect

    deepspeed_real = pytest.importorskip("deepspeed")
    import deepspeed.moe.layer  # noqa: F401
    import deepspeed.moe.utils  # noqa: F401
    import deepspeed.pipe  # noqa: F401
    from nnscaler_plugins.adapters import deepspeed as ours

    def params(f):
        return [(p.name, p.kind, p.default if not callable(p.default) else "callable")
                for p in inspect.signature(f).parameters.values()]

    pairs = [(ours.moe.layer.MoE.__init__, deepspeed_real.moe.layer.MoE.__init__),
             (ours.moe.utils.split_params_into_different_moe_groups_for_optimizer,
              deepspeed_real.moe.utils.split_params_into_different_moe_groups_for_optimizer),
             (ours.pipe.LayerSpec.__init__, deepspeed_real.pipe.LayerSpec.__init__),
             (ours.pipe.PipelineModule.forward, None)]
    for mine, theirs in pairs[:3]:
        assert params(mine) == params(theirs), mine
    mine = params(ours.pipe.PipelineModule.__init__)
    theirs = params(deepspeed_real.pipe.PipelineModule.__init__)
    assert [p[:2] for p in mine] == [p[:2] for p in theirs]
    assert [p[0] for p in params(ours.pipe.TiedLayerSpec.__init__)] == \
        [p[0] for p in params(deepspeed_real.pipe.TiedLayerSpec.__init__)]
    for f in ("recursive_getattr", "recursive_setattr"):
        assert params(getattr(ours.compression.helper, f)) == params(getattr(deepspeed_real.utils.module_utils, f))


def test_moe_param_groups_and_refused_moe_layer() -> None:
    import torch

    from nnscaler_plugins.adapters import deepspeed

    model = torch.nn.Linear(4, 4)
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    assert len(groups) == 1 and groups[0]["params"] == list(model.parameters())  # no expert: as it was
    expert = torch.nn.Linear(4, 4)
    expert.weight.allreduce, expert.weight.group_name = False, "ep_size_1"  # DeepSpeed's expert mark
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": [model.weight, expert.weight], "name": "decay", "lr": 0.1}])
    assert [g["params"] for g in groups] == [[model.weight], [expert.weight]]
    assert groups[1]["moe"] and groups[1]["name"] == "ep_size_1" and groups[1]["lr"] == 0.1
    with pytest.raises(NotImplementedError, match=r"deepspeed.moe.layer.MoE .*TopKGate.*'plan': 'ep'"):
        deepspeed.moe.layer.MoE(hidden_size=4, expert=expert, num_experts=2, k=1)


def test_compression_helper_reaches_modules_by_name() -> None:
    import torch

    from nnscaler_plugins.adapters.deepspeed.compression.helper import recursive_getattr, recursive_setattr

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = torch.nn.Linear(2, 2)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new


def test_pipeline_module_refuses_what_it_cannot_run() -> None:
    import torch

    from nnscaler_plugins.adapters.deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(torch.nn.Linear, 4, 4)]
    with pytest.raises(DeepSpeedConfigError, match=r"partition_method='type:Linear'.*'parameters' or 'uniform'"):
        PipelineModule(layers, num_stages=2, partition_method="type:Linear")
    with pytest.raises(DeepSpeedConfigError, match=r"activation_checkpoint_interval=1.*recompute"):
        PipelineModule(layers, num_stages=2, activation_checkpoint_interval=1)
    with pytest.raises(DeepSpeedConfigError, match=r"topology=.*num_stages="):
        PipelineModule(layers, topology=object())
    with pytest.raises(RuntimeError, match="must provide num_stages or topology"):
        PipelineModule(layers)


# -- PipelineModule's train_batch / eval_batch on 2 gloo processes against one process --------------
@pytest.fixture(scope="module")
def workers2(deepspeed_workers2):
    """The DeepSpeed modules' own pool (tests/conftest.py), not the session's shared one."""
    return deepspeed_workers2


def _specs(tied: bool) -> list:
    import torch

    from nnscaler_plugins.adapters.deepspeed.pipe import LayerSpec, TiedLayerSpec

    if tied:  # an embedding whose weight is also the output projection (DeepSpeed's GPT pattern)
        return [TiedLayerSpec("embed", torch.nn.Embedding, 10, 8), LayerSpec(torch.nn.Linear, 8, 8), torch.nn.Tanh(),
                TiedLayerSpec("embed", torch.nn.Embedding, 10, 8, forward_fn=_project)]
    return [LayerSpec(torch.nn.Linear, 8, 16), torch.nn.ReLU(), LayerSpec(torch.nn.Linear, 16, 16), torch.nn.Tanh(),
            LayerSpec(torch.nn.Linear, 16, 4)]


def _tied_loss(out, y):
    import torch

    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def _project(embedding, x):
    return x @ embedding.weight.t()


def _reference(tied: bool):
    """The same layers as one eager model, each drawn after the seed DeepSpeed's seed_layers gives it."""
    import torch

    if tied:
        torch.manual_seed(1234)
        emb = torch.nn.Embedding(10, 8)
        torch.manual_seed(1235)
        lin = torch.nn.Linear(8, 8)
        return torch.nn.ModuleList([emb, lin]), lambda x: _project(emb, torch.tanh(lin(emb(x))))
    mods = []
    for i, make in enumerate([lambda: torch.nn.Linear(8, 16), torch.nn.ReLU, lambda: torch.nn.Linear(16, 16),
                              torch.nn.Tanh, lambda: torch.nn.Linear(16, 4)]):
        torch.manual_seed(1234 + i)
        mods.append(make())
    seq = torch.nn.Sequential(*mods)
    return seq, seq


def _data(tied: bool, n: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    if tied:
        return [(ids := torch.randint(0, 10, (4, 3), generator=g), torch.roll(ids, 1, 1)) for _ in range(n)]
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _pipeline_job(rank: int, world: int, num_stages: int, tied: bool) -> dict:
    import torch

    from nnscaler_plugins.adapters import deepspeed

    steps, acc = 2, 2
    dp = world // num_stages
    loss_fn = _tied_loss if tied else torch.nn.CrossEntropyLoss()
    model = deepspeed.pipe.PipelineModule(_specs(tied), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True,
                                          partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": acc, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    # each data-parallel rank its own micro-batches; the ranks of one pipeline the same ones
    per_replica = [_data(tied, steps * acc, seed=10 + r) for r in range(dp)]
    mine = per_replica[rank % dp if num_stages == 1 else 0]
    data = iter(mine)
    losses = [engine.train_batch(data_iter=data).item() for _ in range(steps)]
    out = {"losses": losses, "steps": engine.global_steps, "dp": engine.dp_world_size,
           "pipeline": engine.parallel_module.plan.pipeline is not None,
           "state": {k: v.clone() for k, v in engine.module_state_dict().items()}}
    if num_stages == 1:
        out["eval"] = engine.eval_batch(iter(_data(tied, acc, seed=99 + rank))).item()
    # the reference: one process, the whole global batch of each micro-step (the replicas' together)
    ref, fwd = _reference(tied)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for s in range(steps):
        step_loss = 0.0
        for m in range(acc):
            x = torch.cat([d[s * acc + m][0] for d in per_replica])
            y = torch.cat([d[s * acc + m][1] for d in per_replica])
            loss = _tied_loss(fwd(x), y) if tied else torch.nn.functional.cross_entropy(fwd(x), y)
            (loss / acc).backward()
            step_loss += loss.item() / acc
        opt.step()
        opt.zero_grad()
        ref_losses.append(step_loss)
    out["ref_losses"] = ref_losses
    out["ref_state"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    if num_stages == 1:
        with torch.no_grad():
            evals = [torch.nn.functional.cross_entropy(fwd(x), y).item()  # (untied model only)
                     for r in range(world) for x, y in _data(tied, acc, seed=99 + r)]
        out["ref_eval"] = sum(evals) / len(evals)
    return out


@pytest.mark.parametrize("num_stages,tied", [(2, False), (1, False), (2, True)])
def test_pipeline_module_train_batch_equals_one_process(workers2, num_stages, tied) -> None:
    for r in workers2.run(_pipeline_job, num_stages, tied):
        assert r["pipeline"] == (num_stages > 1) and r["dp"] == 2 // num_stages and r["steps"] == 2
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        if num_stages == 1:
            assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
        ref = list(r["ref_state"].values())
        mine = list(r["state"].values())
        assert len(mine) == len(ref)  # a tied weight is one parameter
        for a, b in zip(mine, ref):
            assert torch_allclose(a, b), (a, b)


def torch_allclose(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_pipeline_module_train_batch_equals_real_deepspeed(tmp_path) -> None:
    """The same pipeline script (two stages of LayerSpecs, seed_layers) under DeepSpeed 0.19 on
    2 gloo processes and under the drop-in: the same train_batch losses."""
    pytest.importorskip("deepspeed")
    from torchrun_jobs import run_job

    real = run_job(tmp_path, "deepspeed_pipe_job.py", "real")
    ours = run_job(tmp_path, "deepspeed_pipe_job.py", "ours")
    assert len(real) == 3 and real[0] != real[2]
    assert ours == pytest.approx(real, rel=1e-6)
