"""A Trainer subclass's own `compute_loss` under `NNScalerTrainerMixin` (tests/hf_subclass_job.py, 2 gloo
processes under torchrun): the override runs in every training step on the planned model, so the
metric it records (token accuracy read off the outputs) and the count it is given are the plain
single-process subclass's, and so are the logged losses and the trained weights, with 2 batches
accumulated over padded rows of varying length. An override returning a loss other than the
model's own is refused by name. dp by default; NNS_TEST_ALL_PLANS=1 adds tp."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torchrun_jobs import run_job  # noqa: E402

PLANS = ["dp", "tp"] if os.environ.get("NNS_TEST_ALL_PLANS") == "1" else ["dp"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("plain"), "hf_subclass_job.py", "plain", nproc=1)


@pytest.mark.parametrize("plan", PLANS)
def test_subclass_compute_loss_runs_with_its_metrics(tmp_path, plain, plan):
    found = run_job(tmp_path, "hf_subclass_job.py", plan, nproc=2)
    assert len(found["recorded"]) == len(plain["recorded"]) == 6  # 3 steps of 2 batches
    for got, want in zip(found["recorded"], plain["recorded"]):
        assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-9)
        assert got["count"] == want["count"]
    assert found["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert found["weights"] == pytest.approx(plain["weights"], rel=1e-6)


def test_a_loss_other_than_the_models_is_refused(tmp_path):
    found = run_job(tmp_path, "hf_subclass_job.py", "dp-changed", nproc=2)
    assert "Recording.compute_loss returned a loss other than the planned model's own" in found["refused"]
