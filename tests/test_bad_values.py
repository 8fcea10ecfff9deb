"""Every bad value a user can write is refused by name, before any process group exists: a property
test mutates valid plan files, plan options and DeepSpeed configs (one value replaced by another of
any JSON type, or a key removed) and checks that each result is either a valid plan / config or the
library's own named error (PlanError, DeepSpeedConfigError and its kinds) whose message names the
field; never a raw Python exception ("invalid literal for int()", "'int' object is not iterable").

Hypothesis draws the mutations (derandomized, so a run is repeatable); a few hundred examples of
each take seconds once the small model is captured.
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models

VALUES = st.sampled_from(["2", "x", "", 1.5, -1, 0, 1, 10 ** 6, True, False, None, [], {}, [1], ["i", 2],
                          [["i", 2]], {"a": 1}, "auto", float("inf")])
SETTINGS = settings(max_examples=250, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def graph():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.mlp()
    return nns.capture(model, batch)


@pytest.fixture(scope="module")
def plan_files(graph):
    import nnscaler_plugins as nns

    made = [nns.plan(graph, strategy=s, world_size=2, **o) for s, o in
            (("tp", {}), ("dp", {"zero": 2, "collective_timeout_s": 30.0}), ("hybrid", {"tp": 2, "dp": 1}))]
    return [json.loads(json.dumps(p.to_json())) for p in made]


def _paths(x, pre=()):
    """Every (path, value) in a JSON document, the document itself excluded."""
    if pre:
        yield pre
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, pre + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, pre + (i,))


def _mutate(doc, data, skip=()):
    """`doc` with one value replaced (or one key removed); returns (document, path)."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p[0] not in skip]
    path = data.draw(st.sampled_from(paths), label="path")
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and data.draw(st.integers(0, 9), label="remove") == 0:
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(VALUES, label="value")
    return doc, path


def _names_the_field(message: str, path: tuple) -> bool:
    return any(isinstance(k, str) and k in message for k in path)


@SETTINGS
@given(data=st.data())
def test_a_mutated_plan_file_is_a_valid_plan_or_a_named_error(graph, plan_files, data):
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.plan.plan import Plan
    from nnscaler_plugins.plan.validate import validate

    base = data.draw(st.sampled_from(plan_files), label="plan")
    doc, path = _mutate(base, data, skip=("estimate",))  # free-form notes of the search, never read back
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate(Plan.from_json(doc), graph, world_size=2)
    except PlanError as e:
        whole = path[0] == "ops" and len(path) <= 2  # the op table or one op's entry replaced whole
        assert whole or _names_the_field(str(e), path), (path, str(e))


@SETTINGS
@given(data=st.data())
def test_every_knob_of_a_plan_file_is_a_knob_or_a_named_error(data):
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.plan.knobs import KNOB_NAMES, Knobs

    name = data.draw(st.sampled_from(KNOB_NAMES), label="knob")
    value = data.draw(st.one_of(VALUES, st.dictionaries(st.sampled_from(["op", "x"]), VALUES, max_size=2)),
                      label="value")
    try:
        Knobs.from_json({name: value})
    except PlanError as e:
        assert name in str(e), (name, value, str(e))


def test_a_plan_file_of_the_wrong_shape_is_named():
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.plan.plan import Plan

    with pytest.raises(PlanError, match="holds one JSON object"):
        Plan.from_json([{"format": "nnscaler-plan"}])


OPTIONS = ["zero", "precision", "offload", "micro_batches", "tp", "dp", "collective_timeout_s", "compile",
           "on_nonfinite", "overlap_grad_reduce", "report_dir"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(OPTIONS), value=VALUES, world=st.sampled_from([2, "2", 0, 2.0, None, -1]))
def test_plan_options_and_world_size_are_a_plan_or_a_named_error(graph, name, value, world):
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nns.plan(graph, strategy="hybrid" if name in ("tp", "dp") else "dp", world_size=world, **{name: value})
    except PlanError as e:
        assert name in str(e) or "world_size" in str(e), (name, value, world, str(e))


_DEEPSPEED = [
    {"train_batch_size": 8, "gradient_accumulation_steps": 2,
     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}},
     "bf16": {"enabled": True, "check_grad_overflow": True},
     "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "overlap_comm": True,
                           "offload_optimizer": {"device": "cpu"}},
     "gradient_clipping": 1.0, "steps_per_print": 5, "wall_clock_breakdown": False, "nnscaler": {"plan": "dp"}},
    {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                                                   "nesterov": True}},
     "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 2,
              "min_loss_scale": 1, "consecutive_hysteresis": False},
     "scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}},
     "checkpoint": {"tag_validation": "Warn"}, "dataloader_drop_last": False},
]


@SETTINGS
@given(data=st.data())
def test_a_mutated_deepspeed_config_is_a_config_or_a_named_error(data):
    from nnscaler_plugins.adapters.deepspeed.config import resolve_batch, translate
    from nnscaler_plugins.adapters.deepspeed.errors import DeepSpeedConfigError

    doc, path = _mutate(data.draw(st.sampled_from(_DEEPSPEED), label="config"), data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolve_batch(translate(doc), 2)
    except DeepSpeedConfigError as e:
        batch = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
        assert _names_the_field(str(e), path) or path[0] in batch, (path, str(e))


@pytest.mark.parametrize("config,field", [
    ({"train_batch_size": 2, "fp16": {"enabled": "false"}}, "fp16.enabled"),
    ({"train_batch_size": 2, "wall_clock_breakdown": "no"}, "wall_clock_breakdown"),
    ({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": "0.1"}}}, "optimizer.params.lr"),
    ({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": "yes"}}},
     "optimizer.params.nesterov"),
    ({"train_batch_size": 2, "scheduler": {"type": "StepLR", "params": {"gamma": "0.5"}}}, "scheduler.params.gamma"),
    ({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": 3}}, "optimizer.params"),
])
def test_deepspeed_values_of_the_wrong_type_are_named(config, field):
    """A string "false" read by its truth is true: each such value is refused, naming its key."""
    from nnscaler_plugins.adapters.deepspeed.config import translate
    from nnscaler_plugins.adapters.deepspeed.errors import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match=field.replace(".", r"\.")):
        translate(config)


@pytest.mark.parametrize("options", [{"collective_timeout_s": "20"}, {"zero": "1"}, {"tp": "2"},
                                     {"micro_batches": 1.5}, {"precision": 16}])
def test_adapter_settings_are_checked_where_they_are_written(options):
    """Lightning's strategy and the HF Trainer's arguments refuse a bad value at construction,
    before `fit` / `train` make any process group."""
    from nnscaler_plugins.adapters.hf import NNScalerTrainingArguments
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy
    from nnscaler_plugins.errors import PlanError

    name = next(iter(options))
    with pytest.raises(PlanError, match=f"NNScalerStrategy.*{name}="):
        NNScalerStrategy(plan="tp", **options)
    with pytest.raises(PlanError, match=f"NNScalerTrainingArguments.*{name}="):
        NNScalerTrainingArguments(output_dir="/tmp/nns_test_args", plan="tp", plan_options=options)
