"""The Lightning strategy across a Trainer's stages: validate before any fit, fit, validate, test,
predict, validate again, a resumed fit (`ckpt_path="last"` and a new Trainer from the checkpoint)
on one Trainer, each stage on its own batches, against the same sequence under strategy="ddp"; and
what the strategy leaves behind (threads, files in the current directory, the process group, the
generated-code cache under `default_root_dir`) and what the planned LightningModule pickles to.

One 2-process launch (tests/lightning_stages_job.py) runs DDP and the plans one after another.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ALL_PLANS

pytest.importorskip("lightning")

from nnscaler_plugins.adapters.lightning_strategy import CACHE_ENV, generated_code_dir  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_stages_job.py")


def _close(a, b, rel: float = 1e-5) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-6)
    return a == b


def test_cache_dir_is_given_or_from_the_environment_or_under_default_root_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert generated_code_dir(None, str(tmp_path)) == os.path.join(str(tmp_path), ".nnscaler_cache")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert generated_code_dir(None, str(tmp_path)) == str(tmp_path / "env")
    assert generated_code_dir(str(tmp_path / "mine"), str(tmp_path)) == str(tmp_path / "mine")


def test_every_stage_in_any_order_on_one_trainer_as_under_ddp(tmp_path):
    """dp (and zero3 with NNS_TEST_ALL_PLANS=1): every rank's per-batch losses in each stage, the logged
    metrics, the predictions, the resumed fits and the unpickled module's weights and outputs are DDP's."""
    plans = ["dp", "zero3"] if ALL_PLANS else ["dp"]
    cwd, out, root = tmp_path / "cwd", tmp_path / "out", tmp_path / "root"
    for d in (cwd, out, root):
        d.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop(CACHE_ENV, None)
    proc = subprocess.run([sys.executable, JOB, str(out), str(root), "ddp", *plans], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert os.listdir(cwd) == [], os.listdir(cwd)  # nothing written where the script started
    for rank in (0, 1):
        ref = json.loads((out / f"ddp.{rank}.json").read_text())
        for plan in plans:
            got = json.loads((out / f"{plan}.{rank}.json").read_text())
            stages = [s[0] for s in got["seen"]]
            assert stages[0] == "validate" and "test" in stages and stages.count("fit") == 5, stages
            for key in ("seen", "resumed_seen", "metrics", "preds"):
                assert _close(got[key], ref[key]), (plan, rank, key, got[key], ref[key])
            # eval stages ran the model in eval mode, training in training mode
            assert all(s[3] == (s[0] == "fit") for s in got["seen"]), got["seen"]
            # the pickle is the plain model with DDP's whole weights, and torch.save gives the same
            assert got["pickled"]["type"] == "Net" and got["pickled"]["same"], got["pickled"]
            assert _close(got["pickled"], ref["pickled"]), (got["pickled"], ref["pickled"])
            left = got["left"]
            assert [t for t in left["threads"] if t not in ref["left"]["threads"]
                    and t != "child-process-observer"] == [], left  # Lightning's own launcher thread only
            assert left["dist"] == ref["left"]["dist"] and left["cwd"] == [], left
            assert any(c.startswith(str(root / plan)) for c in got["caches"]), got["caches"]


@pytest.mark.skipif(not ALL_PLANS, reason="a second launch; NNS_TEST_ALL_PLANS=1 runs it")
def test_a_captured_plan_runs_every_stage_as_one_device(tmp_path):
    """tp (captured, one replica: both ranks read every batch, so no distributed sampler) against one
    device run by the launching process: each stage's per-batch losses, the metrics, the
    predictions, the resumed fits and the pickled module (its weights gathered from the pieces)."""
    cwd, out, root = tmp_path / "cwd", tmp_path / "out", tmp_path / "root"
    for d in (cwd, out, root):
        d.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", NNS_STAGES_SAMPLER="0")
    env.pop(CACHE_ENV, None)
    proc = subprocess.run([sys.executable, JOB, str(out), str(root), "single", "tp"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert os.listdir(cwd) == [], os.listdir(cwd)
    ref = json.loads((out / "single.0.json").read_text())
    for rank in (0, 1):
        got = json.loads((out / f"tp.{rank}.json").read_text())
        for key in ("seen", "resumed_seen", "metrics", "preds", "pickled"):
            assert _close(got[key], ref[key]), (rank, key, got[key], ref[key])
        assert got["left"]["cwd"] == [] and any(c.startswith(str(root / "tp")) for c in got["caches"]), got
