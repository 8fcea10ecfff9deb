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
