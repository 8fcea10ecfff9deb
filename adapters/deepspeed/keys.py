"""Every DeepSpeed config key this engine knows, and what it does with it.

A key is ACCEPT-ed (honoured with DeepSpeed's meaning), WARN-ed (accepted, but it only tunes how
DeepSpeed itself runs -- buckets, monitors, profilers -- and has no effect on what is computed here;
the warning names it), or REFUSE-d (it would change the results or needs a feature this engine does
not have: running on would be a silent wrong answer). A key in none of the tables is refused as
unknown, so a misspelt key never passes unnoticed.

A section that only switches on a DeepSpeed feature (a monitor, a profiler, the hybrid engine) is
OFF_ONLY: scripts write it with `"enabled": false` (DeepSpeed-Chat writes `hybrid_engine` and
`tensorboard` that way), and then it asks for nothing, so it is accepted silently; enabled, it is
refused, since the feature does not run here, and the reason says what to use instead.
"""
from __future__ import annotations

ACCEPT, WARN, REFUSE, OFF_ONLY = "accept", "warn", "refuse", "off-only"

# Top-level keys. The reason is what the user reads in the warning or error.
TOP_LEVEL: dict[str, tuple[str, str]] = {
    "train_batch_size": (ACCEPT, "global batch = micro x accumulation x data-parallel size"),
    "train_micro_batch_size_per_gpu": (ACCEPT, "batch of one forward on one data-parallel rank"),
    "gradient_accumulation_steps": (ACCEPT, "micro-batches per optimizer step"),
    "optimizer": (ACCEPT, "built from {type, params}"),
    "scheduler": (ACCEPT, "DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    "fp16": (ACCEPT, "fp16 with loss scaling"),
    "bf16": (ACCEPT, "bf16"),
    "bfloat16": (ACCEPT, "old name of bf16"),
    "zero_optimization": (ACCEPT, "ZeRO stage"),
    "gradient_clipping": (ACCEPT, "clip the global gradient norm at each optimizer step"),
    "steps_per_print": (ACCEPT, "log lr and step every N optimizer steps"),
    "wall_clock_breakdown": (ACCEPT, "log forward/backward/step times at steps_per_print"),
    "dataloader_drop_last": (ACCEPT, "drop_last of the data loader built from training_data"),
    "nnscaler": (ACCEPT, "this engine's plan: {'plan': name | plan file, options...}"),
    "managed_gradient_accumulation": (ACCEPT, "false: every step() is a boundary, the caller accumulates"),
    "prescale_gradients": (ACCEPT, "only false: gradients are averaged after the sum here"),
    "gradient_predivide_factor": (ACCEPT, "only 1.0"),
    "gradient_allreduce_op": (ACCEPT, "only 'mean': gradients are averaged over data-parallel ranks"),
    "communication_data_type": (ACCEPT, "only fp32 (or unset): gradients are reduced in their own dtype"),
    "zero_allow_untested_optimizer": (WARN, "every torch optimizer runs here; the flag has no effect"),
    "zero_force_ds_cpu_optimizer": (ACCEPT, "true (DeepSpeed's default): a client optimizer under offload_optimizer "
                                            "is refused with ZeRORuntimeException, as DeepSpeed refuses it"),
    "memory_breakdown": (WARN, "DeepSpeed's memory logging is not reproduced"),
    "dump_state": (WARN, "DeepSpeed's state dump is not reproduced"),
    "log_level": (WARN, "use Python logging for 'nnscaler_plugins'"),
    "flops_profiler": (OFF_ONLY, "no flops profiler here; price a plan with nnscaler-plan simulate, or profile "
                                  "with torch.profiler"),
    "tensorboard": (OFF_ONLY, "monitors are not reproduced; log the loss engine(...) returns and engine.get_lr() "
                               "from your script (torch.utils.tensorboard.SummaryWriter)"),
    "wandb": (OFF_ONLY, "monitors are not reproduced; log the loss and engine.get_lr() from your script (wandb.log)"),
    "csv_monitor": (OFF_ONLY, "monitors are not reproduced; write the loss and engine.get_lr() from your script"),
    "comet": (OFF_ONLY, "monitors are not reproduced; log the loss and engine.get_lr() from your script"),
    "comms_logger": (OFF_ONLY, "communication logging is not reproduced; nnscaler-plan simulate lists a plan's "
                                "collectives, torch.profiler times them"),
    "timers": (WARN, "DeepSpeed's timers are not reproduced (wall_clock_breakdown works)"),
    "compile": (ACCEPT, "deepcompile: true runs the per-rank program under torch.compile (the plan's compile knob), "
                        "as engine.compile() does"),
    "autotuning": (OFF_ONLY, "DeepSpeed's autotuner is not run; use 'nnscaler': {'plan': 'auto'}, which searches "
                              "the plan"),
    "aio": (WARN, "no NVMe offload here (host-memory offload needs no aio settings)"),
    "checkpoint": (ACCEPT, "tag_validation; load_universal (a ds_to_universal folder)"),
    "activation_checkpointing": (WARN, "deepspeed.checkpointing is not reproduced; use the plan's recompute= option"),
    "disable_allgather": (WARN, "a communication tuning knob with no effect here"),
    "pipeline": (WARN, "choose a pipeline with 'nnscaler': {'plan': '1f1b', 'pp': N} instead"),
    "seq_parallel_communication_data_type": (WARN, "no DeepSpeed sequence parallelism here"),
    "torch_autocast": (REFUSE, "autocast changes the numerics; use bf16 or fp16"),
    "data_types": (ACCEPT, "grad_accum_dtype: unset or the model's own dtype (gradients accumulate in it here)"),
    "hybrid_engine": (OFF_ONLY, "the RLHF hybrid engine is not reproduced; generate with the model itself "
                                 "(engine.eval(), then engine.module or the model's own generate)"),
    "tensor_parallel": (REFUSE, "AutoTP is not reproduced; use 'nnscaler': {'plan': 'tp'}"),
    "expert_parallel": (REFUSE, "expert parallelism is not supported"),
    "sequence_parallel_size": (REFUSE, "DeepSpeed-Ulysses is not supported"),
    "data_parallel_size": (REFUSE, "the data-parallel size comes from the plan; use 'nnscaler': {'dp': N}"),
    "weight_quantization": (REFUSE, "weight quantization is not supported"),
    "data_efficiency": (REFUSE, "data efficiency (curriculum, random-LTD) is not supported"),
    "zenflow": (REFUSE, "ZenFlow is not supported"),
    # Removed from DeepSpeed in 0.19 (DeepSpeed refuses the block even switched off); a block whose
    # techniques are all off asks for nothing, so it is accepted here.
    "compression_training": (OFF_ONLY, "DeepSpeed's compression library (quantization, pruning, layer reduction) "
                                       "was removed in DeepSpeed 0.19 and is not reproduced; train the model as it "
                                       "is, or quantize/prune it with torch.ao before or after training"),
}

# Removed from DeepSpeed in 0.19; DeepSpeed itself refuses them (DeepSpeedConfigError).
REMOVED_TOP_LEVEL = ("nebula", "amp", "quantize_training", "sparse_gradients",
                     "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
                     "progressive_layer_drop")

ZERO: dict[str, tuple[str, str]] = {
    "stage": (ACCEPT, "0, 1, 2 or 3"),
    "offload_param": (ACCEPT, "device 'cpu': ZeRO-3's parameter chunks (and the optimizer) in host memory; "
                              "'nvme' is refused"),
    "offload_optimizer": (ACCEPT, "device 'cpu': optimizer state and step in host memory; 'nvme' is refused"),
    "cpu_offload": (ACCEPT, "old name of offload_optimizer.device='cpu'"),
    "cpu_offload_param": (ACCEPT, "old name of offload_param.device='cpu'"),
    "cpu_offload_use_pin_memory": (ACCEPT, "accepted: host copies are pinned when a GPU computes"),
    "stage3_gather_16bit_weights_on_model_save": (WARN, "checkpoints here always hold whole weights"),
    "stage3_gather_fp16_weights_on_model_save": (WARN, "checkpoints here always hold whole weights"),
    "zero_hpz_partition_size": (ACCEPT, "only 1: hierarchical partitioning (ZeRO++) is not supported"),
    "zero_quantized_weights": (ACCEPT, "only false: ZeRO++ quantization is not supported"),
    "zero_quantized_nontrainable_weights": (ACCEPT, "only false: ZeRO++ quantization is not supported"),
    "zero_quantized_gradients": (ACCEPT, "only false: ZeRO++ quantization is not supported"),
    "mics_shard_size": (REFUSE, "removed from DeepSpeed 0.19"),
    "mics_hierarchical_params_gather": (REFUSE, "removed from DeepSpeed 0.19"),
    "zeropp_loco_param": (REFUSE, "removed from DeepSpeed 0.19"),
}
# Buckets, prefetching and overlap: how DeepSpeed schedules its communication. They change no
# result, so they are accepted with one warning naming them.
for _k in ("contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
           "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights",
           "elastic_checkpoint", "sub_group_size", "round_robin_gradients", "ignore_unused_parameters",
           "memory_efficient_linear", "leaf_module", "compute_grad_norm", "stage3_prefetch_bucket_size",
           "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
           "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_module_granularity_threshold",
           "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "log_trace_cache_warnings",
           "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
           "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
           "pipeline_loading_checkpoint", "override_module_apply", "enable_sanity_checks", "parameter_alignment",
           "legacy_stage1", "save_muon_momentum_buffer_in_memory"):
    ZERO.setdefault(_k, (WARN, "a DeepSpeed communication/memory tuning knob with no effect on results here"))

FP16: dict[str, tuple[str, str]] = {
    "enabled": (ACCEPT, ""),
    "loss_scale": (ACCEPT, "0 = dynamic"),
    "initial_scale_power": (ACCEPT, "dynamic scale starts at 2**power"),
    "loss_scale_window": (ACCEPT, "steps without overflow before the scale doubles"),
    "hysteresis": (ACCEPT, "overflows tolerated before the scale halves"),
    "consecutive_hysteresis": (ACCEPT, "refill hysteresis after a good step"),
    "min_loss_scale": (ACCEPT, "floor of the dynamic scale"),
    "auto_cast": (ACCEPT, "only false: inputs are not cast"),
    "fp16_master_weights_and_grads": (ACCEPT, "only false: master weights are fp32"),
}

BF16: dict[str, tuple[str, str]] = {
    "enabled": (ACCEPT, ""),
    "immediate_grad_update": (WARN, "a DeepSpeed gradient-accumulation detail with no effect here"),
    "check_overflow": (WARN, "an older name; bf16 overflow checking is check_grad_overflow"),
    "check_grad_overflow": (ACCEPT, "true (DeepSpeed's default): a step whose gradients hold inf/nan is skipped"),
    "bf16_master_weights_and_grads": (ACCEPT, "only false: master weights are fp32"),
    "bf16_optimizer_states": (ACCEPT, "only false: optimizer states are fp32"),
}

CHECKPOINT: dict[str, tuple[str, str]] = {
    "tag_validation": (ACCEPT, "Ignore, Warn or Fail when ranks save under different tags"),
    "load_universal": (ACCEPT, "load_checkpoint reads the folder DeepSpeed's ds_to_universal writes, under any "
                               "ZeRO stage, plan or world size"),
    "use_node_local_storage": (WARN, "every rank writes its own files here anyway"),
    "parallel_write": (WARN, "a DeepSpeed I/O tuning knob with no effect here"),
    "writer": (WARN, "a DeepSpeed I/O tuning knob with no effect here"),
}

# DeepSpeed's zero_optimization model checks these values' types and bounds; so does this engine.
ZERO_VALUE_TYPES: dict[str, str] = {
    "reduce_bucket_size": "int>0",
    **dict.fromkeys(("allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "param_persistence_threshold",
                     "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
                     "max_reuse_distance", "zero_hpz_partition_size"), "int>=0"),
    **dict.fromkeys(("stage3_model_persistence_threshold", "model_persistence_threshold",
                     "stage3_module_granularity_threshold"), "int"),
    **dict.fromkeys(("contiguous_gradients", "reduce_scatter", "overlap_comm", "use_multi_rank_bucket_allreduce",
                     "allgather_partitions", "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint",
                     "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                     "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
                     "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
                     "round_robin_gradients", "parameter_alignment", "zero_quantized_weights",
                     "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "memory_efficient_linear",
                     "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                     "enable_sanity_checks", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"), "bool"),
}

DATA_TYPES: dict[str, tuple[str, str]] = {
    "grad_accum_dtype": (ACCEPT, "only unset or the model's dtype: gradients accumulate in the parameter dtype"),
}

# DeepSpeed's "compile" section configures DeepCompile, its compiler passes over the ZeRO model. Here
# the per-rank program is compiled by regions (torch.compile between the collectives), and DeepCompile's
# own schedule knobs have nothing to act on.
_DEEPCOMPILE_ONLY = "tunes DeepCompile's passes, which the generated per-rank program does not use"
COMPILE: dict[str, tuple[str, str]] = {
    "deepcompile": (ACCEPT, "true: the per-rank program runs under torch.compile"),
    **{k: (WARN, _DEEPCOMPILE_ONLY) for k in (
        "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes")},
}

SECTIONS = {"data_types": DATA_TYPES, "zero_optimization": ZERO, "fp16": FP16, "bf16": BF16, "bfloat16": BF16,
            "checkpoint": CHECKPOINT, "compile": COMPILE}
