"""Shared fixtures: one set of real worker processes (one process group) per world size for the
whole session: interpreter, torch and gloo start-up dominate on 2 cores. A module whose work
changes process-wide state (importing DeepSpeed patches torch functions) overrides these with
module-scoped fixtures of its own."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import Workers  # noqa: E402

ALL_PLANS = os.environ.get("NNS_TEST_ALL_PLANS") == "1"

# Long tests whose guarantee another default test already covers in a shorter form (CI runs the
# suite in under 20 minutes on 2 cores); NNS_TEST_ALL_PLANS=1 runs them. A node id, or its prefix
# up to "[" for every parameter of a test. Keep the reason: it says which default test stands in.
LONG = {
    "tests/test_hf_seq2seq.py::test_seq2seq_trains_evaluates_and_generates_as_the_plain_trainer[tp]":
        "a second 2-process Seq2Seq run, about 3 minutes; dp runs by default",
    "tests/test_faults.py::test_adapters_resume_a_killed_job_their_own_way_exactly":
        "three frameworks' resumes, 3 minutes; the plain loop's kill/resume runs by default",
    "tests/test_deepspeed_side_by_side.py::test_same_losses_as_deepspeed_for_zero_0_to_3":
        "real DeepSpeed at 4 stages, 4 minutes; test_deepspeed_conformance runs by default",
    "tests/test_zero_vs_deepspeed.py::test_loss_trajectory_matches_deepspeed":
        "real DeepSpeed; test_deepspeed_conformance runs by default",
    "tests/test_hf_trainer.py::test_llama_two_processes_dp_tp_pipeline_resume_and_save":
        "the HF example script and the padding collators run by default",
    "tests/test_hf_trainer.py::test_gpt2_four_processes_tp_and_pipeline_with_data_parallel":
        "the HF example script and the padding collators run by default",
    "tests/test_hf_trainer.py::test_zero_plans_with_accumulation_and_resume":
        "ZeRO through the Lightning strategy and the DeepSpeed engine run by default",
    "tests/test_lightning.py::test_four_processes_bf16_mixed_in_the_pytorch_lightning_package":
        "two-process Lightning runs by default",
    "tests/test_lightning.py::test_zero_plans_rebuild_the_optimizer_with_accumulation_clipping_and_resume":
        "test_two_processes_all_plans_with_accumulation_clipping_and_resume runs by default",
    "tests/test_adapters_any_shape.py::test_hf_trainer_with_padding_collators_equals_a_plain_trainer[lm]":
        "the padding collator case runs by default",
    "tests/test_adapters_any_shape.py::test_lightning_with_per_batch_padding_trains_like_one_process":
        "the HF Trainer's padding collator and the DeepSpeed engine's variable-length loader run by default",
    "tests/test_adapter_resume.py::test_whole_state_saved_on_two_loads_on_four_under_other_plans":
        "four processes; the per-rank refusal and test_checkpoint's plan changes run by default",
    "tests/test_frontier_runs.py::test_every_frontier_plan_runs_2[llama_small]": "GPT-2's frontier runs by default",
    "tests/test_frontier_runs.py::test_every_frontier_plan_runs_4": "the world-2 frontier runs by default",
    "tests/test_pipeline.py::test_3d_equivalence_8": "world 8; the world-4 pipeline equivalences run by default",
    "tests/test_auto.py::test_auto_equivalence_4[llama_small]": "GPT-2 at world 4 runs by default",
    "tests/test_auto.py::test_auto_equivalence_4[gpt2_small]":
        "auto at world 2 runs GPT-2 and Llama; the main job (test_main_job) trains GPT-2 under auto at world 4",
    "tests/test_precision.py::test_half_precision_with_pipelines": "bf16 against one process runs by default",
    "tests/test_zero.py::test_zero_stages_with_pipeline_pp2_dp2": "ZeRO stages under dp and tp x dp run by default",
    "tests/test_equivalence.py::test_equivalence_4[gpt2_small-dp-options3]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp, the MLP's cases and the hybrids",
    "tests/test_equivalence.py::test_equivalence_4[gpt2_small-tp-options4]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp, the MLP's cases and the hybrids",
    "tests/test_equivalence.py::test_equivalence_4[llama_small-dp-options5]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp, the MLP's cases and the hybrids",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-gpipe-options4]":
        "GPT-2 runs every schedule at world 2, Llama runs them at world 4",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-1f1b-options5]":
        "GPT-2 runs every schedule at world 2, Llama runs them at world 4",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-zero-bubble-options6]":
        "GPT-2 runs every schedule at world 2, Llama runs them at world 4",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-2-1f1b-options2-1]":
        "world 4 runs interleaved with dp and with tp, 4-stage 1F1B, tp x pp with sequence parallelism and interlaced",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-2-zero-bubble-options3-1]":
        "world 4 runs interleaved with dp and with tp, 4-stage 1F1B, tp x pp with sequence parallelism and interlaced",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-4-gpipe-options5-1]":
        "world 4 runs interleaved with dp and with tp, 4-stage 1F1B, tp x pp with sequence parallelism and interlaced",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-2-megatron-options6-2]":
        "world 4 runs interleaved with dp and with tp, 4-stage 1F1B, tp x pp with sequence parallelism and interlaced",
    "tests/test_unruled_ops.py::test_rule_less_ops_between_split_ops_4": "the same rule-less ops run at world 2",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[megatron":
        "dp, tp, zero3, 1f1b and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[interleaved":
        "dp, tp, zero3, 1f1b and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[zero-bubble":
        "dp, tp, zero3, 1f1b and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[coshard":
        "dp, tp, zero3, 1f1b and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[interlaced":
        "dp, tp, zero3, 1f1b and auto run by default",
}


def long_reason(nodeid: str) -> "str | None":
    """Why the test `nodeid` is in LONG (None when it is not)."""
    for prefix, why in LONG.items():
        if nodeid == prefix or nodeid.startswith(prefix if "[" in prefix else prefix + "["):
            return why
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the LONG tests unless NNS_TEST_ALL_PLANS=1, saying which default test stands in."""
    if ALL_PLANS:
        return
    for item in items:
        why = long_reason(item.nodeid)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"long ({why}); NNS_TEST_ALL_PLANS=1 runs it"))


@pytest.fixture(scope="session")
def workers2() -> Iterator[Workers]:
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="session")
def deepspeed_workers2() -> Iterator[Workers]:
    """Two workers for the DeepSpeed modules only: importing DeepSpeed in a worker patches torch
    functions for the rest of that process, so these are kept apart from the shared pools."""
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="session")
def workers4() -> Iterator[Workers]:
    with Workers(4) as w:
        yield w
