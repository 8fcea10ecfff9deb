"""`NNScalerSeq2SeqTrainer` with `NNScalerSeq2SeqTrainingArguments` against the plain single-process
`Seq2SeqTrainer`, on a tiny T5 built from a `T5Config` (tests/hf_seq2seq_job.py, 2 gloo processes
under torchrun): the logged training losses, `evaluate`'s loss and the ids it generated
(`predict_with_generate`), and `predict`'s generated ids and loss are the same under dp and tp."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torchrun_jobs import run_job  # noqa: E402


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("plain"), "hf_seq2seq_job.py", "plain", nproc=1)


@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_seq2seq_trains_evaluates_and_generates_as_the_plain_trainer(tmp_path, plain, plan):
    found = run_job(tmp_path, "hf_seq2seq_job.py", plan, nproc=2)
    assert found["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert found["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert found["predict_loss"] == pytest.approx(plain["predict_loss"], rel=1e-5)
    assert found["predict_ids"] == plain["predict_ids"]  # generated with the trained weights
    assert found["evaluate_ids"] == plain["evaluate_ids"]


def test_seq2seq_arguments_take_the_plan_from_a_command_line(tmp_path):
    from transformers import HfArgumentParser, Seq2SeqTrainingArguments

    from nnscaler_plugins.adapters.hf import NNScalerSeq2SeqTrainingArguments

    (args,) = HfArgumentParser(NNScalerSeq2SeqTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--plan", "tp", "--plan_options", '{"tp": 2}',
         "--predict_with_generate", "--generation_max_length", "9"])
    assert isinstance(args, Seq2SeqTrainingArguments)
    assert (args.plan, args.plan_options, args.predict_with_generate, args.generation_max_length) == \
        ("tp", {"tp": 2}, True, 9)
