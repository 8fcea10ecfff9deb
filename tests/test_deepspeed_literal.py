"""DeepSpeed's own engine tests through a literal import swap (tests/deepspeed_literal.py).

Needs a DeepSpeed checkout (NNS_DEEPSPEED_REPO: a work tree or a bare git directory) and DeepSpeed
installed (its harness starts the processes; internal classes the tests name stay its own); skipped
otherwise, as on CI, which runs the mirrored tests (test_deepspeed_conformance.py) instead.

By default a few tests, one per behaviour scripts depend on, run through the swap; with
NNS_TEST_ALL_PLANS=1 every test `deepspeed_literal_results.json` records as passing on DeepSpeed,
and at least 97 % of those not exempt (DeepSpeed's internals, listed with reasons in the runner)
must pass through the swap.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import deepspeed_literal as literal  # noqa: E402 - the runner beside this file

ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
pytestmark = [
    pytest.mark.skipif(not os.environ.get("NNS_DEEPSPEED_REPO"),
                       reason="set NNS_DEEPSPEED_REPO to a DeepSpeed checkout to run its own tests through the swap"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="DeepSpeed's test harness needs DeepSpeed installed: pip install 'deepspeed>=0.19,<0.20'"),
]

# One test per behaviour (each passes on DeepSpeed 0.19.8 on its CPU accelerator, and through the swap).
DEFAULT = [
    # a client LR scheduler without its optimizer object, as DeepSpeed 0.19.8 takes it
    "unit/runtime/test_ds_initialize.py::TestClientLrScheduler::test[None-_LRScheduler]",
    # the config's Adam is DeepSpeed's FusedAdam
    "unit/runtime/test_ds_initialize.py::TestConfigOptimizer::test[True]",
    # GatheredParameters on a ZeRO-3 engine's parameters gives them whole
    "unit/runtime/zero/test_zero_context.py::TestSerialContext::test_ext_param_getattr",
    # a checkpoint of a model with tied weights saved and loaded (test_convert_checkpoint's test is left
    # out: its ranks write the same pytorch_model.bin at once, and one may read it half-written)
    "unit/checkpoint/test_shared_weights.py::TestCheckpointSharedWeights::test_checkpoint_shared_weights",
    # a write under GatheredParameters(modifier_rank=...) reaches every rank
    "unit/runtime/zero/test_zero_context.py::TestGatherUpdate::test",
    # GatheredParameters around load_state_dict_from_zero_checkpoint
    "unit/v1/zero/test_zero.py::TestZeroToFP32::test_1_param_group[True-3]",
    # the tag checks of save_checkpoint
    "unit/checkpoint/test_tag_validation.py::TestCheckpointValidationTag::test_checkpoint_unique_tag[FAIL]",
]


def _results() -> dict:
    return json.loads(literal.RESULTS.read_text())


def test_deepspeeds_own_tests_pass_through_the_swap(tmp_path) -> None:
    recorded = _results()
    real = recorded["real"]
    if ALL:
        ids = [i for i, (o, _) in real.items() if o == "passed"]
    else:
        ids = DEFAULT
        assert all(real.get(i, ["missing"])[0] == "passed" for i in ids), "the default tests must pass on DeepSpeed"
    files = sorted({i.split("::", 1)[0].removeprefix("unit/") for i in ids})
    tests, _ = literal.prepare(tmp_path, "swap", files)
    env = literal.environment()
    got = literal.run_side(tests, ids, tmp_path / "swap.jsonl", env, per_test_timeout=300)
    failed = {i: got.get(i, ["missing", ""]) for i in ids if got.get(i, ["missing"])[0] != "passed"}
    if not ALL:
        assert not failed, failed
        return
    counted = [i for i in ids if not literal.exempt_reason(i)]
    passing = [i for i in counted if i not in failed]
    assert len(passing) >= 0.97 * len(counted), (len(passing), len(counted), failed)
