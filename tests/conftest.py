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
        "the HF example script and the accumulation runs run by default",
    "tests/test_hf_trainer.py::test_gpt2_four_processes_tp_and_pipeline_with_data_parallel":
        "the HF example script and the accumulation runs run by default",
    "tests/test_hf_trainer.py::test_zero_plans_with_accumulation_and_resume":
        "ZeRO through the Lightning strategy and the DeepSpeed engine run by default",
    "tests/test_lightning.py::test_four_processes_bf16_mixed_in_the_pytorch_lightning_package":
        "two-process Lightning runs by default",
    "tests/test_lightning.py::test_zero_plans_rebuild_the_optimizer_with_accumulation_clipping_and_resume":
        "test_two_processes_all_plans_with_accumulation_clipping_and_resume runs by default",
    "tests/test_adapters_any_shape.py::test_hf_trainer_with_padding_collators_equals_a_plain_trainer[lm]":
        "the HF accumulation and subclass runs pad rows of varying length by default",
    "tests/test_adapters_any_shape.py::test_lightning_with_per_batch_padding_trains_like_one_process":
        "test_variable_shapes runs other sizes by default",
    "tests/test_adapter_resume.py::test_whole_state_saved_on_two_loads_on_four_under_other_plans":
        "four processes; test_checkpoint's plan changes run by default",
    "tests/test_frontier_runs.py::test_every_frontier_plan_runs_2[llama_small]": "the sequence-parallel search plan's run runs by default",
    "tests/test_frontier_runs.py::test_every_frontier_plan_runs_4": "the sequence-parallel search plan's run runs by default",
    "tests/test_pipeline.py::test_3d_equivalence_8": "world 8; the world-4 pipeline equivalences run by default",
    "tests/test_auto.py::test_auto_equivalence_4[llama_small]": "GPT-2 at world 4 runs by default",
    "tests/test_auto.py::test_auto_equivalence_4[gpt2_small]":
        "auto at world 2 runs GPT-2 and Llama; the main job (test_main_job) trains GPT-2 under auto at world 4",
    "tests/test_precision.py::test_half_precision_with_pipelines": "bf16 against one process runs by default",
    "tests/test_zero.py::test_zero_stages_with_pipeline_pp2_dp2": "ZeRO stages under dp run by default",
    "tests/test_equivalence.py::test_equivalence_4[gpt2_small-dp-options3]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp and the MLP's cases",
    "tests/test_equivalence.py::test_equivalence_4[gpt2_small-tp-options4]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp and the MLP's cases",
    "tests/test_equivalence.py::test_equivalence_4[llama_small-dp-options5]":
        "every model and strategy runs at world 2; world 4 runs Llama's tp and the MLP's cases",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-gpipe-options4]":
        "world 2 and world 4 run their first schedule by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-1f1b-options5]":
        "world 2 and world 4 run their first schedule by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[llama_small-2-zero-bubble-options6]":
        "world 2 and world 4 run their first schedule by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-2-1f1b-options2-1]":
        "world 4 runs its first case by default; world 2 runs GPT-2's schedules",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-2-zero-bubble-options3-1]":
        "world 4 runs its first case by default; world 2 runs GPT-2's schedules",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-4-gpipe-options5-1]":
        "world 4 runs its first case by default; world 2 runs GPT-2's schedules",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[gpt2_small-2-megatron-options6-2]":
        "world 4 runs its first case by default; world 2 runs GPT-2's schedules",
    "tests/test_unruled_ops.py::test_rule_less_ops_between_split_ops_4": "the same rule-less ops run at world 2",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[megatron":
        "dp, tp and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[interleaved":
        "dp, tp and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[zero-bubble":
        "dp, tp and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[coshard":
        "dp, tp and auto run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[interlaced":
        "dp, tp and auto run by default",
    # -- each capability once by default; a sweep's later cases and tests another default test stands in for --
    "tests/test_hf_subclass.py::test_a_loss_other_than_the_models_is_refused":
        "a 2-process job for one refusal; the subclass's dp training run runs by default",
    "tests/test_main_job.py::test_a_plan_failing_in_the_processes_is_one_line":
        "test_main_job_trains_auto_equal_and_reports_a_failing_plan_on_one_line runs by default",
    "tests/test_lightning.py::test_a_model_capture_cannot_take_trains_as_under_ddp[zero3]":
        "the dp case runs by default",
    "tests/test_adapter_resume.py::test_per_rank_state_is_refused_under_another_plan_or_world":
        "test_checkpoint's refusals of a changed plan or world run by default",
    "tests/test_eager_executor.py::test_the_hf_trainer_trains_a_model_capture_cannot_take_as_the_plain_trainer":
        "the eager executor under Lightning and the eager fallback run by default",
    "tests/test_compile.py::test_variable_lengths_compile_once_per_shape_template":
        "compiled plans' equivalence and never-recompile tests run by default",
    "tests/test_faults.py::test_two_launchers_as_two_nodes_train_like_one_process":
        "the killed-rank resumes run by default",
    "tests/test_faults.py::test_restart_on_fewer_processes_keeps_the_global_batch_and_the_trajectory":
        "the killed-rank resumes run by default",
    "tests/test_faults.py::test_kill_during_a_background_save_keeps_the_previous_checkpoint":
        "the kill at a random step under tp, ZeRO-3 and a pipeline runs by default",
    "tests/test_packed_sequences.py::test_packed_rows_train_like_one_process_under_dp_tp_and_1f1b":
        "the flex-attention masks made from each batch run by default",
    "tests/test_adapters_any_shape.py::test_hf_trainer_with_padding_collators_equals_a_plain_trainer[padding]":
        "the HF accumulation and subclass runs pad rows of varying length by default",
    "tests/test_adapters_any_shape.py::test_deepspeed_engine_with_a_variable_length_loader_trains_like_one_process":
        "test_variable_shapes runs other sizes by default",
    "tests/test_frontier_runs.py::test_every_frontier_plan_runs_2[gpt2_small]":
        "the sequence-parallel search plan's run and the search tests run by default",
    "tests/test_zero.py::test_zero_stages_tp2_dp2":
        "test_zero_stages_dp2 runs by default",
    "tests/test_unruled_ops.py::test_rule_less_ops_between_split_ops_2":
        "each rule-less op's capture runs by default",
    "tests/test_meta_adapters.py::test_hf_trainer_meta_model_with_weights_or_model_init":
        "test_meta_init's plans run by default",
    "tests/test_plugins.py::test_broken_plugin_is_named_and_switches_skip_it":
        "the third-party strategy by entry point runs by default",
    "tests/test_lightning.py::test_registered_in_both_namespaces_without_importing_lightning_eagerly":
        "the Lightning runs under both packages' names run by default",
    "tests/test_resharding.py::test_all_pairs_4":
        "the world-2 resharding pairs run by default",
    "tests/test_search.py::test_frontier_covers_brute_force[16]":
        "the 8-device case runs by default",
    "tests/test_hf_accumulation.py::test_the_mean_of_the_means_when_the_trainer_or_the_model_says_so[loss_is_scaled_for_ga]":
        "the accepts_loss_kwargs case runs by default",
    "tests/test_overlap.py::test_every_plan_runs_as_priced[v100-p3]":
        "the h100 cluster's case runs by default",
    "tests/test_float8.py::test_rowwise_recipes_and_compile":
        "the converted linears' defaults and knobs run by default",
    "tests/test_overlap.py::test_sequence_parallel_gathers_run_in_chunks_2":
        "tp overlap plans' equivalence runs by default",
    "tests/test_flex_attention.py::test_masks_made_from_each_batch_train_like_one_process":
        "masks passed to forward run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[dp{'zero': 3}]":
        "the dp and tp cases run by default",
    "tests/test_variable_shapes.py::test_other_sizes_train_like_one_process[1f1b{'pp': 2, 'micro_batches': 2}]":
        "the dp and tp cases run by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-4-interleaved-options1-1]":
        "a sweep: its first case, test_pipeline_equivalence_4[gpt2_small-4-interleaved-options0-2], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-4-1f1b-options4-1]":
        "a sweep: its first case, test_pipeline_equivalence_4[gpt2_small-4-interleaved-options0-2], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-2-megatron-options7-1]":
        "a sweep: its first case, test_pipeline_equivalence_4[gpt2_small-4-interleaved-options0-2], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_4[llama_small-2-interlaced-options8-1]":
        "a sweep: its first case, test_pipeline_equivalence_4[gpt2_small-4-interleaved-options0-2], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[gpt2_small-2-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[gpt2_small-4-slow-links]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[gpt2_small-4-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[llama_small-2-slow-links]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[llama_small-2-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[llama_small-4-slow-links]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[llama_small-4-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[vit_small-2-slow-links]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[vit_small-2-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[vit_small-4-slow-links]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_auto_parallel.py::test_auto_divides_the_work[vit_small-4-cpu-preset]":
        "a sweep: its first case, test_auto_divides_the_work[gpt2_small-2-slow-links], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[tp]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[zero3]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[1f1b]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[interleaved]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[cp]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_memory_priced_vs_measured.py::test_priced_memory_equals_measured_2[tp, selective recompute]":
        "a sweep: its first case, test_priced_memory_equals_measured_2[dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[falcon-tp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[mixtral-dp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[mixtral-tp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[deberta_v2-dp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[deberta_v2-tp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[resnet-dp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_zoo.py::test_zoo_trains_like_one_process[resnet-tp]":
        "a sweep: its first case, test_zoo_trains_like_one_process[falcon-dp], runs by default",
    "tests/test_expert_parallel.py::test_ep_4[mixtral-options1-1]":
        "a sweep: its first case, test_ep_4[mixtral-options0-2], runs by default",
    "tests/test_expert_parallel.py::test_ep_4[mixtral-options2-1]":
        "a sweep: its first case, test_ep_4[mixtral-options0-2], runs by default",
    "tests/test_expert_parallel.py::test_ep_4[mixtral-options3-1]":
        "a sweep: its first case, test_ep_4[mixtral-options0-2], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[gpt2_small-2-1f1b-options1]":
        "a sweep: its first case, test_pipeline_equivalence_2[gpt2_small-2-gpipe-options0], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[gpt2_small-2-zero-bubble-options2]":
        "a sweep: its first case, test_pipeline_equivalence_2[gpt2_small-2-gpipe-options0], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[gpt2_small-2-recycling-options3]":
        "a sweep: its first case, test_pipeline_equivalence_2[gpt2_small-2-gpipe-options0], runs by default",
    "tests/test_pipeline.py::test_pipeline_equivalence_2[gpt2_small-2-interlaced-options7]":
        "a sweep: its first case, test_pipeline_equivalence_2[gpt2_small-2-gpipe-options0], runs by default",
    "tests/test_equivalence.py::test_equivalence_hybrid_4[gpt2_small-hybrid]":
        "a sweep: its first case, test_equivalence_hybrid_4[mlp-hybrid], runs by default",
    "tests/test_equivalence.py::test_equivalence_hybrid_4[llama_small-hybrid]":
        "a sweep: its first case, test_equivalence_hybrid_4[mlp-hybrid], runs by default",
    "tests/test_overlap.py::test_tp_overlap_plans_train_like_one_process_2[False-llama_small]":
        "a sweep: its first case, test_tp_overlap_plans_train_like_one_process_2[False-gpt2_small], runs by default",
    "tests/test_overlap.py::test_tp_overlap_plans_train_like_one_process_2[True-gpt2_small]":
        "a sweep: its first case, test_tp_overlap_plans_train_like_one_process_2[False-gpt2_small], runs by default",
    "tests/test_overlap.py::test_tp_overlap_plans_train_like_one_process_2[True-llama_small]":
        "a sweep: its first case, test_tp_overlap_plans_train_like_one_process_2[False-gpt2_small], runs by default",
    "tests/test_megatron_experts.py::test_megatron_with_experts_plans_what_strategy_ep_plans[options1-4]":
        "a sweep: its first case, test_megatron_with_experts_plans_what_strategy_ep_plans[options0-2], runs by default",
    "tests/test_megatron_experts.py::test_megatron_with_experts_plans_what_strategy_ep_plans[options2-4]":
        "a sweep: its first case, test_megatron_with_experts_plans_what_strategy_ep_plans[options0-2], runs by default",
    "tests/test_megatron_experts.py::test_megatron_with_experts_plans_what_strategy_ep_plans[options3-2]":
        "a sweep: its first case, test_megatron_with_experts_plans_what_strategy_ep_plans[options0-2], runs by default",
    "tests/test_megatron_experts.py::test_megatron_with_experts_plans_what_strategy_ep_plans[options4-2]":
        "a sweep: its first case, test_megatron_with_experts_plans_what_strategy_ep_plans[options0-2], runs by default",
    "tests/test_overlap.py::test_every_plan_runs_as_priced[a100-dgx]":
        "a sweep: its first case, test_every_plan_runs_as_priced[v100-p3], runs by default",
    "tests/test_overlap.py::test_every_plan_runs_as_priced[h100-dgx]":
        "a sweep: its first case, test_every_plan_runs_as_priced[v100-p3], runs by default",
    "tests/test_overlap.py::test_every_plan_runs_as_priced[h200]":
        "a sweep: its first case, test_every_plan_runs_as_priced[v100-p3], runs by default",
    "tests/test_overlap.py::test_every_plan_runs_as_priced[local-cpu]":
        "a sweep: its first case, test_every_plan_runs_as_priced[v100-p3], runs by default",
    "tests/test_overlap.py::test_zero_gathers_under_next_forward_2[None-2]":
        "a sweep: its first case, test_zero_gathers_under_next_forward_2[None-1], runs by default",
    "tests/test_overlap.py::test_zero_gathers_under_next_forward_2[False-1]":
        "a sweep: its first case, test_zero_gathers_under_next_forward_2[None-1], runs by default",
    "tests/test_overlap.py::test_zero_gathers_under_next_forward_2[False-2]":
        "a sweep: its first case, test_zero_gathers_under_next_forward_2[None-1], runs by default",
    "tests/test_outside_zoo.py::test_outside_code_trains_like_one_process[vit-zero3]":
        "a sweep: its first case, test_outside_code_trains_like_one_process[nanogpt-gpipe], runs by default",
    "tests/test_outside_zoo.py::test_outside_code_trains_like_one_process[titan_llama-tp]":
        "a sweep: its first case, test_outside_code_trains_like_one_process[nanogpt-gpipe], runs by default",
    "tests/test_outside_zoo.py::test_outside_code_trains_like_one_process[reference_llama-gpipe]":
        "a sweep: its first case, test_outside_code_trains_like_one_process[nanogpt-gpipe], runs by default",
    "tests/test_outside_zoo.py::test_outside_code_trains_like_one_process[hf_mixtral-ep]":
        "a sweep: its first case, test_outside_code_trains_like_one_process[nanogpt-gpipe], runs by default",
    "tests/test_recompute.py::test_recompute_equivalence_2[llama_small-tp-selective]":
        "a sweep: its first case, test_recompute_equivalence_2[gpt2_small-tp-full], runs by default",
    "tests/test_recompute.py::test_recompute_equivalence_2[llama_small-dp-LlamaMLP]":
        "a sweep: its first case, test_recompute_equivalence_2[gpt2_small-tp-full], runs by default",
    "tests/test_shape_values.py::test_trains_like_one_process_with_dropout[lightning-demo-tp]":
        "a sweep: its first case, test_trains_like_one_process_with_dropout[lightning-demo-dp], runs by default",
    "tests/test_shape_values.py::test_trains_like_one_process_with_dropout[nn-transformer-encoder-dp]":
        "a sweep: its first case, test_trains_like_one_process_with_dropout[lightning-demo-dp], runs by default",
    "tests/test_shape_values.py::test_trains_like_one_process_with_dropout[nn-transformer-encoder-tp]":
        "a sweep: its first case, test_trains_like_one_process_with_dropout[lightning-demo-dp], runs by default",
    "tests/test_shape_values.py::test_trains_like_one_process_with_dropout[nn-transformer-encoder-zero3]":
        "a sweep: its first case, test_trains_like_one_process_with_dropout[lightning-demo-dp], runs by default",
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
