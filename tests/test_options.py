"""Strategy options are declared and checked by every entry point before anything starts: a misspelt
option is refused naming the option, the strategy and the closest valid name, and the training knobs
every strategy takes are valid everywhere. Single process, no workers."""
from __future__ import annotations

import models
import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.plan.source import COMMON_OPTIONS, check_options, strategy_options
from nnscaler_plugins.plugins import get_strategy, strategies


class DataDependent(torch.nn.Module):
    """Capture refuses it: a refusal that names an option proves capture never ran."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return h.pow(2).mean()


def test_every_builtin_strategy_declares_its_options():
    for name in strategies():
        own = strategy_options(get_strategy(name))
        assert own is not None and not own & COMMON_OPTIONS, (name, own)
    assert {"tp", "pp", "dp", "schedule", "virtual_stages", "sequence_parallel", "recompute"} <= \
        strategy_options(get_strategy("megatron"))
    assert {"chunks", "modules"} <= strategy_options(get_strategy("coshard"))
    assert "schedule" not in strategy_options(get_strategy("1f1b"))  # the schedule is its name


@pytest.mark.parametrize("strategy,options,bad,close", [
    ("megatron", {"tpp": 2}, "tpp", "tp"),
    ("dp", {"micro_batchs": 2}, "micro_batchs", "micro_batches"),
    ("1f1b", {"pp": 2, "virtual_stage": 2}, "virtual_stage", "virtual_stages"),
    ("coshard", {"chunk": 2}, "chunk", "chunks"),
    ("tp", {"zer0": 1}, "zer0", "zero"),
])
def test_nns_plan_refuses_a_misspelt_option_before_capture(strategy, options, bad, close):
    with pytest.raises(nns.PlanError) as e:
        nns.plan(DataDependent(), strategy=strategy, world_size=2, example_inputs=torch.randn(2, 4), **options)
    text = str(e.value)
    assert f"no option {bad!r}" in text and f"did you mean {close!r}" in text and f"strategy {strategy!r}" in text


def test_training_knobs_are_valid_for_every_strategy():
    model, inputs = models.mlp()
    p = nns.plan(model, strategy="dp", world_size=2, example_inputs=inputs, zero=1, precision="fp32",
                 micro_batches=2, constraints=(), cluster=None)
    assert p.zero == 1 and p.num_micro_batches == 2
    for name in strategies():
        check_options(name, {k: None for k in COMMON_OPTIONS})


def test_a_ready_plan_takes_only_the_training_knobs(tmp_path):
    model, inputs = models.mlp()
    p = nns.plan(model, strategy="dp", world_size=2, example_inputs=inputs)
    with pytest.raises(nns.PlanError, match="ready Plan .*no option 'tp'"):
        nns.plan(model, strategy=p, world_size=2, example_inputs=inputs, tp=2)
    p.save(str(tmp_path / "p.json"))
    with pytest.raises(nns.PlanError, match="plan file .*no option 'dp'"):
        check_options(str(tmp_path / "p.json"), {"dp": 2})
    check_options(p, {"zero": 1})


def test_third_party_strategies_declare_options_or_fall_back_to_keyword_parameters():
    model, inputs = models.mlp()

    def keywords(builder, *, chunks=2):
        for op in builder.ops:
            builder.replicate(op)

    def declared(builder, **options):
        keywords(builder)

    declared.options = ("width",)

    def anything(builder, **options):
        keywords(builder)

    assert strategy_options(keywords) == {"chunks", "tp", "dp"}  # no degrees: nns.plan reads tp/dp itself
    with pytest.raises(nns.PlanError, match="strategy 'keywords' has no option 'chunk' .*did you mean 'chunks'"):
        nns.plan(model, strategy=keywords, world_size=1, example_inputs=inputs, chunk=3)
    assert nns.plan(model, strategy=keywords, world_size=1, example_inputs=inputs, chunks=3, zero=1).zero == 1
    with pytest.raises(nns.PlanError, match="no option 'widht' .*did you mean 'width'"):
        nns.plan(model, strategy=declared, world_size=1, example_inputs=inputs, widht=3)
    nns.plan(model, strategy=declared, world_size=1, example_inputs=inputs, width=3)
    assert strategy_options(anything) is None  # **options and no declaration: cannot be checked
    nns.plan(model, strategy=anything, world_size=1, example_inputs=inputs, whatever=3)

    from nnscaler_plugins.strategies import (
        Strategy,  # the built-ins' wrapper, usable by plugins too
    )

    def one_unit(world_size, **_):
        return world_size, 1

    assert strategy_options(Strategy("kw", keywords, one_unit)) == {"chunks"}  # its function's parameters
    assert strategy_options(Strategy("decl", anything, one_unit, "", ("width",))) == {"width"}


def test_registered_third_party_strategy_is_checked_by_name():
    from nnscaler_plugins.hookspecs import hookimpl
    from nnscaler_plugins.plugins import register, unregister

    def toy(builder, **_):
        for op in builder.ops:
            builder.replicate(op)

    toy.options = ("depth",)

    class Plugin:
        @hookimpl
        def nnscaler_register_strategies(self):
            return {"toy-options": toy}

    plugin = Plugin()
    register(plugin, name="toy-options-plugin")
    try:
        with pytest.raises(nns.PlanError, match="strategy 'toy-options' has no option 'dept' .*'depth'"):
            check_options("toy-options", {"dept": 1})
        check_options("toy-options", {"depth": 1, "zero": 1})
    finally:
        unregister(plugin)


def test_nns_parallelize_refuses_before_touching_the_cache_or_the_process_group(tmp_path):
    import torch.distributed as dist

    model, inputs = models.mlp()
    cache = tmp_path / "cache"
    was = dist.is_initialized()
    with pytest.raises(nns.PlanError, match="strategy 'hybrid' has no option 'tpp' .*'tp'"):
        nns.parallelize(model, inputs, plan="hybrid", tpp=2, cache_dir=str(cache))
    assert not cache.exists() and dist.is_initialized() == was


def test_lightning_strategy_checks_options_at_construction():
    pytest.importorskip("lightning")
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    with pytest.raises(nns.PlanError, match=r"NNScalerStrategy\(...\): strategy 'megatron' has no option 'tpp' "
                                            r"\(did you mean 'tp'\?\)"):
        NNScalerStrategy(plan="megatron", tpp=2)
    with pytest.raises(nns.PlanError, match="no option 'micro_batchs' .*'micro_batches'"):
        NNScalerStrategy(plan="1f1b", pp=2, micro_batchs=2)
    with pytest.raises(NotImplementedError, match="precision='bf16' in the plan"):
        NNScalerStrategy(plan="dp", precision="bf16")
    assert NNScalerStrategy(plan="megatron", tp=2, micro_batches=2, zero=1).plan_options == \
        {"tp": 2, "micro_batches": 2, "zero": 1}


def test_hf_arguments_and_mixin_check_plan_options(tmp_path):
    pytest.importorskip("transformers")
    from nnscaler_plugins.adapters.hf import (
        NNScalerTrainerMixin,
        NNScalerTrainingArguments,
    )
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(nns.PlanError, match=r"NNScalerTrainingArguments\(plan_options=...\): strategy 'dp' has no "
                                            r"option 'micro_batchs' \(did you mean 'micro_batches'\?\)"):
        NNScalerTrainingArguments(**common, plan="dp", plan_options={"micro_batchs": 2})
    assert NNScalerTrainingArguments(**common, plan="tp", plan_options={"tp": 2, "zero": 1}).plan_options["tp"] == 2

    class MyTrainer(NNScalerTrainerMixin, Trainer):
        pass

    model = torch.nn.Linear(4, 4)
    with pytest.raises(nns.PlanError, match=r"MyTrainer\(plan_options=...\): strategy 'megatron' has no option 'tpp'"):
        MyTrainer(model=model, args=TrainingArguments(**common), plan="megatron", plan_options={"tpp": 2})


def test_deepspeed_nnscaler_section_is_checked_before_the_process_group():
    import torch.distributed as dist
    from nnscaler_plugins.adapters import deepspeed
    from nnscaler_plugins.adapters.deepspeed.config import translate

    # option names are checked once, by the session initialize makes (below); the config's own checks here
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="nnscaler.zero: the config's own sections set it"):
        translate({"train_batch_size": 4, "nnscaler": {"plan": "tp", "zero": 2}})
    was = dist.is_initialized()
    for section, pattern in [({"plan": "hybrid", "tpp": 2}, "no option 'tpp' \\(did you mean 'tp'\\?\\)"),
                             ({"plan": "tensor"}, "unknown strategy 'tensor'")]:
        with pytest.raises(deepspeed.DeepSpeedConfigError, match=pattern):
            deepspeed.initialize(model=torch.nn.Linear(4, 4), config={"train_batch_size": 4, "nnscaler": section})
    assert dist.is_initialized() == was
    assert translate({"train_batch_size": 4, "nnscaler": {"plan": "1f1b", "pp": 2}}).plan_options == {"pp": 2}
