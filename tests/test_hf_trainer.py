"""The Hugging Face Trainer adapter: argument checks in-process, and real torchrun runs (gloo) of
`recipes/hf_trainer_llama.py`, which compares every plan's logged losses with a plain single-process
Trainer on the same global batch, resumes from a checkpoint, and reloads `save_model`'s directory with
`AutoModelForCausalLM.from_pretrained`; it exits non-zero on any mismatch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "hf_trainer_llama.py")


def _run_recipe(tmp_path, *args: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, RECIPE, "--out", str(tmp_path), *args], env=env, capture_output=True,
                          text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"plan"')]
    assert proc.returncode == 0, f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return rows


def test_arguments_refuse_other_engines_and_bad_plans(tmp_path):
    from transformers import Trainer, TrainingArguments

    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainerMixin, NNScalerTrainingArguments

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="plan= and deepspeed= cannot be combined"):
        NNScalerTrainingArguments(**common, plan="tp", deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="plan= and fsdp=.*cannot be combined"):
        NNScalerTrainingArguments(**common, plan="tp", fsdp="full_shard")
    with pytest.raises(ValueError, match="unknown strategy 'tpp'; registered: .*tp"):
        NNScalerTrainingArguments(**common, plan="tpp")
    assert NNScalerTrainingArguments(**common, plan="1f1b", plan_options={"micro_batches": 2}).plan == "1f1b"

    class MyTrainer(NNScalerTrainerMixin, Trainer):  # the mixin on any Trainer subclass, any arguments class
        pass

    from recipes_models import tiny_gpt2  # noqa: E402  (defined below through sys.modules)

    model = tiny_gpt2()
    t = MyTrainer(model=model, args=TrainingArguments(**common), plan="tp", plan_options={"tp": 2})
    assert t.nns_plan == "tp" and t.nns_plan_options == {"tp": 2}
    with pytest.raises(TypeError, match="needs a plan"):
        MyTrainer(model=model, args=TrainingArguments(**common))
    with pytest.raises(ValueError, match="deepspeed= cannot be combined"):
        MyTrainer(model=model, args=TrainingArguments(**common, deepspeed={"zero_optimization": {"stage": 1}}),
                  plan="dp")
    assert isinstance(NNScalerTrainer(model=model, args=NNScalerTrainingArguments(**common, plan="dp")), Trainer)


def test_per_rank_optimizer_files_of_another_process_count_are_refused_before_restoring(tmp_path):
    """Checkpoints of an earlier version kept one optimizer file per rank, which only the process count
    that wrote them can read: refused before the weights are restored (this version writes the whole
    state, which any plan and process count resumes)."""
    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments
    from nnscaler_plugins.adapters.resume import ResumeError
    from recipes_models import tiny_gpt2

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    for r in range(2):
        (ckpt / f"optimizer.rank{r}-of-2.pt").write_bytes(b"")
    trainer = NNScalerTrainer(model=tiny_gpt2(), args=NNScalerTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                                 report_to=[], plan="dp"))
    with pytest.raises(ResumeError, match=r"no optimizer state .* for 1 process.*optimizer.rank0-of-2.pt.*nothing was "
                                          "restored"):
        trainer._load_from_checkpoint(str(ckpt))


def test_llama_two_processes_dp_tp_pipeline_resume_and_save(tmp_path):
    """... and the tp run's checkpoint resumes under 1f1b too (the optimizer state is resharded)."""
    rows = _run_recipe(tmp_path, "--nproc", "2", "--model", "llama", "--plans", "tp;dp;1f1b", "--steps", "4",
                       "--resume-check", "--resume-under", "1f1b")
    assert {r["plan"] for r in rows} == {"dp", "tp", "1f1b"}
    for r in rows:
        assert r["match"], r
    resumed = [r for r in rows if "resumed" in r]
    assert resumed and resumed[0]["resume_match"] and resumed[0]["saved_identical"], resumed
    assert resumed[0]["under_match"] == {"1f1b": True}, resumed


def test_zero_plans_with_accumulation_and_resume(tmp_path):
    """ZeRO plans: the Trainer's optimizer is the plan's sharded one (decay groups by name), the
    Trainer's model.zero_grad() clears ZeRO-2's chunks, accumulation scales each step's loss, and a
    ZeRO-2 run resumes exactly."""
    rows = _run_recipe(tmp_path, "--nproc", "2", "--model", "llama", "--plans", "zero2;zero3", "--steps", "4",
                       "--accumulate", "2", "--resume-check", "--resume-under", "dp")
    assert {r["plan"] for r in rows} == {"zero2", "zero3"}
    for r in rows:
        assert r["match"] and r["dp"] == 2, r
    resumed = [r for r in rows if "resumed" in r]
    assert resumed and resumed[0]["resume_match"] and resumed[0]["saved_identical"], resumed
    assert resumed[0]["under_match"] == {"dp": True}, resumed  # ZeRO-2's sharded state into a plain AdamW


def test_gpt2_four_processes_tp_and_pipeline_with_data_parallel(tmp_path):
    rows = _run_recipe(tmp_path, "--nproc", "4", "--model", "gpt2", "--plans", "tp;1f1b:pp=2", "--steps", "2")
    assert {r["plan"]: r["dp"] for r in rows} == {"tp": 1, "1f1b:pp=2": 2}
    for r in rows:
        assert r["match"] and r["nproc"] == 4, r


class _Models:
    @staticmethod
    def tiny_gpt2():
        sys.path.insert(0, os.path.join(ROOT, "recipes"))
        import hf_trainer_llama

        return hf_trainer_llama.build_model("gpt2")


sys.modules.setdefault("recipes_models", _Models)  # a module-like namespace for the import above
