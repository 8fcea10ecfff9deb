"""`NNScalerTrainingArguments` read the way transformers' example scripts read `TrainingArguments`:
`HfArgumentParser` from a command line (`--plan tp --plan_options '{"pp": 2}'`), `parse_dict`,
`parse_json_file` and `parse_yaml_file`; a misspelt strategy or option is refused by name, with the
name meant, before any process starts. In-process and quick: the scripts themselves run in
tests/test_hf_example.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

import nnscaler_plugins as nns  # noqa: E402
from nnscaler_plugins.adapters.hf import NNScalerTrainingArguments  # noqa: E402

# What each option this library adds looks like on a command line, and what it parses to. A new
# option fails `test_every_added_option_parses_from_a_command_line` until it has a sample here.
SAMPLES = {
    "plan": ("1f1b", "1f1b"),
    "plan_options": ('{"pp": 2, "micro_batches": 4}', {"pp": 2, "micro_batches": 4}),
}


@dataclasses.dataclass
class ModelArguments:  # a script's own dataclass beside the training arguments, as in run_clm.py
    model_type: str = "llama"


def _parse(tmp_path, *argv: str) -> NNScalerTrainingArguments:
    parser = HfArgumentParser((ModelArguments, NNScalerTrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu",
                                                           "--report_to", "none", *argv])
    assert model_args.model_type == "llama"
    return args


def test_command_line_with_and_without_plan(tmp_path):
    args = _parse(tmp_path)  # no --plan at all: the default, as for any TrainingArguments field
    assert (args.plan, args.plan_options) == ("dp", {})
    args = _parse(tmp_path, "--plan", "tp", "--per_device_train_batch_size", "4")
    assert (args.plan, args.plan_options, args.per_device_train_batch_size) == ("tp", {}, 4)
    args = _parse(tmp_path, "--plan", "1f1b", "--plan_options", '{"pp": 2}')
    assert (args.plan, args.plan_options) == ("1f1b", {"pp": 2})
    args = _parse(tmp_path, "--plan", "zero3", "--plan-options", '{"micro_batches": 2}')  # the dashed spelling
    assert (args.plan, args.plan_options) == ("zero3", {"micro_batches": 2})


def test_every_added_option_parses_from_a_command_line(tmp_path):
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    added = {f.name for f in dataclasses.fields(NNScalerTrainingArguments)} - own
    assert added == set(SAMPLES), f"give each option a command-line sample in SAMPLES: {sorted(added ^ set(SAMPLES))}"
    for name, (text, value) in SAMPLES.items():
        argv = [f"--{name}", text] + (["--plan", "1f1b"] if name == "plan_options" else [])
        assert getattr(_parse(tmp_path, *argv), name) == value, name


def test_misspelt_strategy_and_option_are_named_with_the_name_meant(tmp_path):
    with pytest.raises(nns.PlanError, match=r"NNScalerTrainingArguments\(plan_options=...\): strategy '1f1b' has no "
                                            r"option 'micro_batchs' \(did you mean 'micro_batches'\?\)"):
        _parse(tmp_path, "--plan", "1f1b", "--plan_options", '{"micro_batchs": 2}')
    with pytest.raises(nns.PlanError, match=r"strategy 'tp' has no option 'tpp' \(did you mean 'tp'\?\)"):
        _parse(tmp_path, "--plan", "tp", "--plan_options", '{"tpp": 2}')
    with pytest.raises(nns.PlanError, match=r"NNScalerTrainingArguments\(plan=...\): unknown strategy 'tpp'; "
                                            r"registered: .*\btp\b"):
        _parse(tmp_path, "--plan", "tpp")


def test_plan_options_that_are_not_a_json_object_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"plan_options=...\): 'pp=2' is not valid JSON .*--plan_options "
                                         r"'\{\"pp\": 2"):
        _parse(tmp_path, "--plan", "1f1b", "--plan_options", "pp=2")
    with pytest.raises(ValueError, match=r"plan_options=...\): '\[2\]' is not a JSON object"):
        _parse(tmp_path, "--plan", "1f1b", "--plan_options", "[2]")
    with pytest.raises(TypeError, match=r"plan_options=...\): expected a dict .* got int"):
        NNScalerTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], plan_options=2)


def test_parse_dict_json_and_yaml_files(tmp_path):
    parser = HfArgumentParser(NNScalerTrainingArguments)
    base = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none"}
    (args,) = parser.parse_dict({**base, "plan": "1f1b", "plan_options": {"pp": 2, "micro_batches": 2}})
    assert (args.plan, args.plan_options) == ("1f1b", {"pp": 2, "micro_batches": 2})
    (args,) = parser.parse_dict({**base, "plan": "tp", "plan_options": '{"tp": 2}'})  # the JSON text, too
    assert args.plan_options == {"tp": 2}

    path = tmp_path / "args.json"
    path.write_text(json.dumps({**base, "plan": "zero3", "plan_options": {"micro_batches": 2}}))
    (args,) = parser.parse_json_file(str(path))
    assert (args.plan, args.plan_options) == ("zero3", {"micro_batches": 2})

    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nplan: 1f1b\n"
                    "plan_options:\n  pp: 2\n  micro_batches: 2\n")
    (args,) = parser.parse_yaml_file(str(path))
    assert (args.plan, args.plan_options) == ("1f1b", {"pp": 2, "micro_batches": 2})
    path.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nplan: 1f1b\nplan_options:\n  micro_batchs: 2\n")
    with pytest.raises(nns.PlanError, match=r"no option 'micro_batchs' \(did you mean 'micro_batches'\?\)"):
        parser.parse_yaml_file(str(path))


def test_arguments_with_a_plan_object_still_serialize(tmp_path):
    """Loggers write the arguments as JSON (`to_json_string`, `to_dict`): a plan given as a function
    is written as its description, a name as itself."""
    def my_strategy(builder):
        pass

    args = NNScalerTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], plan=my_strategy)
    assert args.plan is my_strategy
    written = json.loads(args.to_json_string())
    assert written["plan"] == "strategy 'my_strategy'" and written["plan_options"] == {}
    args = NNScalerTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], plan="tp",
                                     plan_options={"tp": 2})
    assert json.loads(args.to_json_string())["plan"] == "tp"
    assert args.to_sanitized_dict()["plan"] == "tp"
