"""The report set: published points the simulator is evaluated on and never fitted on.

The fitted constants see only `points_fit.py`. Each group of rows below names its source (URL, or
repository and path at the commit read) beside its numbers; the step time of a row is derived from
the published throughput as each builder in calibration.py says.
"""
from __future__ import annotations

import calibration as C

MEGATRON_2021 = "github.com/NVIDIA/Megatron-LM README (images/cases_april2021.png); Narayanan et al. SC'21 Table 1"
KORTHIKANTI = "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', arXiv 2205.05198, " \
              "Table 5 and Figure 1"
ALPA = "github.com/alpa-projects/alpa benchmark README (GPT-2.6B manual plan on one p3.16xlarge)"
LLM_FOUNDRY = "github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md"
TORCHTITAN_2024_12 = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md " \
                     "of 2024-12/2025-01); 405B row: docs/performance.md at 4d88a8a (2024-12-03)"
TORCHTITAN_FLOAT8 = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch 1963fc8, torchao " \
                    "eab345c, torchtitan 9dec370, 2024-12): Table 1 and Table 3 row 'FSDP + torch.compile + Float8', " \
                    "Table 2 row 'FSDP 8, CP 1', Table 4 rows '2D' and '2D + AsyncTP'"
TORCHTITAN_H200 = "github.com/pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (torchtitan e7c0cae, " \
                  "torchao 0afa4c1, 2025-06): rows NUM_NODES 4 and 8; llama3_8b.toml of that commit (sequence 8192, " \
                  "per-op selective AC), float8 with FSDP float8 all-gather, compiled, local batch 2"
TORCHTITAN_A100 = "github.com/pytorch/torchtitan docs/performance.md at 613bfd0 (2024-04-16) and later 2024 versions"
TORCHTITAN_ASYNC_TP = "github.com/pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md " \
                      "(table assets/images/async-tp-perf-06-14-2025.png)"
MEGATRON_BRIDGE_FP8 = "github.com/NVIDIA-NeMo/Megatron-Bridge skills/nemo-mbridge-perf-memory-tuning/SKILL.md at 067f987, " \
                     "'Measured Results' (Llama3 70B SFT, 32 x H100 80GB, FP8 current scaling, seq 4096, MBS 1, GBS 32, " \
                     "VPP 5; from Bridge PR #3107): rows Baseline, More PP, More TP, column 'Peak Mem (GB)'"
MEGATRON_CORE_H100 = "github.com/NVIDIA/Megatron-LM README, 'Training speed and scalability' (images/model_table.png " \
                     "and images/strong_scaling.png, commit f2e5db4, 2024-07-15)"


def _megatron_2021() -> list[C.Case]:
    # source: MEGATRON_2021; name, h, l, heads, tp, pp, GPUs, batch, step time derived from TFLOP/s per GPU
    return [C.megatron_2021("3.6B", 3072, 30, 32, 2, 1, 64, 512, 3.70),
            C.megatron_2021("7.5B", 4096, 36, 32, 4, 1, 128, 512, 3.70),
            C.megatron_2021("39B", 8192, 48, 64, 8, 2, 512, 1536, 14.45),
            C.megatron_2021("76B", 10240, 60, 80, 8, 4, 1024, 1792, 16.06),
            C.megatron_2021("310B", 16384, 96, 128, 8, 16, 1920, 2160, 37.61),
            C.megatron_2021("530B", 20480, 105, 128, 8, 35, 2520, 2520, 54.08)]


def _sequence_parallel_2021() -> list[C.Case]:
    # source: KORTHIKANTI; name, h, l, heads, tp, pp, batch, micro-batch, interleave, full recompute s/step,
    # SP + selective s/step, params+optimizer GiB, activations GiB without recompute, with SP + selective
    rows = [("22B", 6144, 48, 64, 8, 1, 4, 4, 1, 1.42, 1.10, 45.56, 59.25, 9.56),
            ("175B", 12288, 96, 96, 8, 8, 64, 1, 3, 18.13, 13.75, 45.56, 66.84, 12.35),
            ("530B", 20480, 105, 128, 8, 35, 280, 1, 3, 49.05, 37.83, 31.64, 114.02, 23.08),
            ("1T", 25600, 128, 160, 8, 64, 512, 1, 1, 94.42, 71.49, 32.96, 131.25, 26.56)]
    return [c for row in rows for c in C.sequence_parallel_2021(*row)]


def _alpa() -> list[C.Case]:
    # source: ALPA. UniformParallelArgs(prefer_reduce_scatter=True, use_remat=True, dp=2, op=2, pp=2): gradients
    # and optimizer states reduce-scattered over data parallelism (ZeRO-2 style), fp16; 2.464 s/step, 8.745 GB
    return [C.Case("C3", "GPT-2.6B", C.Model(2560, 32, 32, s=1024), "v100-p3", 8, 32, 4,
                   {"tp": 2, "pp": 2, "recompute": "full", "schedule": "1f1b", "zero": 2}, 2.464, {"peak": 8.745},
                   stack=dict(C.MEGATRON_STACK))]


def _llm_foundry() -> list[C.Case]:
    # source: LLM_FOUNDRY; GPU table, model, seq, GPUs, micro-batch, grad accumulation, global batch,
    # activation checkpointing, tokens/s/GPU
    rows = [("H100", "7b", 4096, 8, 16, 2, 256, True, 8611), ("H100", "13b", 2048, 64, 2, 1, 128, False, 4800),
            ("H100", "13b", 4096, 8, 10, 3, 240, True, 4717), ("H100", "70b", 2048, 64, 8, 4, 2048, True, 1039),
            ("H100", "3b", 2048, 16, 10, 3, 480, False, 24142), ("H100", "1b", 8192, 8, 3, 4, 96, False, 29157),
            ("H100", "760m", 2048, 16, 24, 1, 384, False, 68551), ("H100", "13b", 16384, 8, 3, 3, 72, True, 2985),
            ("A100", "70b", 2048, 64, 8, 4, 2048, True, 410), ("A100", "30b", 2048, 8, 3, 21, 504, True, 916),
            ("A100", "13b", 2048, 8, 2, 3, 48, False, 2262), ("A100", "13b", 8192, 8, 5, 3, 120, True, 1795),
            ("A100", "7b", 8192, 8, 8, 2, 128, True, 3206), ("A100", "3b", 4096, 8, 5, 6, 240, False, 9457),
            ("A100", "1b", 2048, 8, 14, 4, 448, False, 20513), ("A100", "760m", 8192, 8, 6, 2, 96, False, 20933)]
    return [C.llm_foundry(*row) for row in rows]


def _torchtitan() -> list[C.Case]:
    out = []
    # source: TORCHTITAN_2024_12; Grand Teton H100 (500 W, HBM2e), bf16 rows only (Float8 ones are not priced).
    # name, model, GPUs, local batch, tp, activation checkpointing, compiled, async TP, tokens/s/GPU, reserved GiB
    h100 = [("8B FSDP 8 GPUs", "llama3-8b", 8, 2, 1, "selective", False, False, 5762, 82.4),
            ("8B FSDP 8 GPUs compiled", "llama3-8b", 8, 2, 1, "selective", True, False, 6667, 77.0),
            ("8B FSDP 128 GPUs", "llama3-8b", 128, 2, 1, "selective", False, False, 5605, 67.0),
            ("8B FSDP 128 GPUs compiled", "llama3-8b", 128, 2, 1, "selective", True, False, 6514, 62.0),
            ("405B FSDP 16 x TP 8", "llama3.1-405b", 128, 2, 8, "full", False, False, 109, None)]
    out += [C.torchtitan("TT-H100", name, key, "H100", gpus, b, tp, rc, comp, atp, tps, mem)
            for name, key, gpus, b, tp, rc, comp, atp, tps, mem in h100]
    # source: TORCHTITAN_ASYNC_TP; 2025-06, torch.compile, bf16: 70B FSDP 32 x TP 8 on 256 H100 (local batch 16,
    # full AC), 8B FSDP 8 x TP 8 on 64 H100 (local batch 12, per-op selective AC); plain TP and async TP
    asyncs = [("70B FSDP 32 x TP 8, plain TP", "llama3-70b", 256, 16, 8, "full", False, 597.3),
              ("70B FSDP 32 x TP 8, async TP", "llama3-70b", 256, 16, 8, "full", True, 652.4),
              ("8B FSDP 8 x TP 8, plain TP", "llama3-8b", 64, 12, 8, "selective", False, 4378.0),
              ("8B FSDP 8 x TP 8, async TP", "llama3-8b", 64, 12, 8, "selective", True, 4809.4)]
    out += [C.torchtitan("TT-H100 TP", name, key, "H100", gpus, b, tp, rc, True, atp, tps, compiled_loss=True)
            for name, key, gpus, b, tp, rc, atp, tps in asyncs]
    # source: TORCHTITAN_FLOAT8; the same Grand Teton H100s, torch.compile + Float8 (torchao Float8Linear, tensorwise
    # dynamic scaling, output projection kept bf16). name, model, GPUs, local batch, tp, AC, async TP, sequence,
    # tokens/s/GPU, reserved GiB
    fp8 = [("8B FSDP 8 GPUs compiled float8", "llama3-8b", 8, 2, 1, "selective", False, 0, 8532, 76.8),
           ("8B FSDP 128 GPUs compiled float8", "llama3-8b", 128, 2, 1, "selective", False, 0, 8380, 61.8),
           ("8B FSDP 8 GPUs s32768 full AC compiled float8", "llama3-8b", 8, 1, 1, "full", False, 32768, 3890, 83.9),
           ("70B FSDP 32 x TP 8 compiled float8", "llama3-70b", 256, 16, 8, "full", False, 0, 829, 71.9),
           ("70B FSDP 32 x TP 8 compiled float8, async TP", "llama3-70b", 256, 16, 8, "full", True, 0, 876, 67.6)]
    out += [C.torchtitan("TT-H100 fp8", name, key, "H100", gpus, b, tp, rc, True, atp, tps, mem, float8=True, seq=seq)
            for name, key, gpus, b, tp, rc, atp, seq, tps, mem in fp8]
    # source: TORCHTITAN_H200; 8 H200 per host, 400 Gb/s per GPU; compiled (the loss too, as torchtitan did from
    # 2025), float8, per-op selective AC, local batch 2
    out += [C.torchtitan("TT-H200 fp8", f"8B FSDP {gpus} GPUs compiled float8", "llama3-8b", "H200", gpus, 2, 1,
                         "selective", True, False, tps, mem, float8=True, compiled_loss=True)
            for gpus, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97))]
    # source: TORCHTITAN_A100; 64 A100 80GB, FSDP, eager: name, model, local batch, AC, tokens/s/GPU
    a100 = [("Llama 3 8B", "llama3-8b", 1, "selective", 2973), ("Llama 3 70B", "llama3-70b", 1, "full", 331),
            ("Llama 2 13B", "llama2-13b", 2, "none", 2162), ("Llama 2 13B, selective op AC", "llama2-13b", 2, "selective", 1904),
            ("Llama 2 70B", "llama2-70b", 2, "full", 353), ("Llama 2 70B, selective op AC", "llama2-70b", 1, "selective", 355)]
    out += [C.torchtitan("TT-A100", name, key, "A100", 64, b, 1, rc, False, False, tps)
            for name, key, b, rc, tps in a100]
    return out


def _megatron_bridge() -> list[C.Case]:
    # source: MEGATRON_BRIDGE_FP8; name, tp, pp, peak in decimal GB as the table gives it (Megatron-Bridge logs
    # memory in 1e9 bytes, and then logged the last rank's: see `megatron_bridge_llama`; the baseline ran out
    # of memory on rank 0 from fragmentation and passed with expandable segments at the same ~59 GB)
    rows = [("70B tp4 pp4 vpp5 dp2 fp8", 4, 4, 58.8), ("70B tp4 pp8 vpp5 dp1 fp8", 4, 8, 53.2),
            ("70B tp8 pp4 vpp5 dp1 fp8", 8, 4, 50.2)]
    return [C.megatron_bridge_llama(name, "llama3-70b", 4096, tp, pp, 5, 32, 32, "selective", mem)
            for name, tp, pp, mem in rows]


def _megatron_core_h100() -> list[C.Case]:
    # source: MEGATRON_CORE_H100 (model table): name, heads, h, l, tp, pp, GPUs, batch, TFLOP/s per GPU (data
    # parallel 48 throughout); then the strong-scaling end points of the 177B row (batch 1152, same model and
    # tp 8 x pp 6): 47 % MFU on 96 GPUs and 42 % on 4608 (989 TFLOP/s peak)
    rows = [("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
            ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
            ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
            ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
            ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9)]
    out = [C.megatron_core_h100(*row) for row in rows]
    out += [C.megatron_core_h100("177B strong scaling, 96 GPUs", 96, 12288, 96, 8, 6, 96, 1152, 0.47 * 989,
                                 source="MLM-H100 strong"),
            C.megatron_core_h100("177B strong scaling, 4608 GPUs", 96, 12288, 96, 8, 6, 4608, 1152, 0.42 * 989,
                                 source="MLM-H100 strong")]
    return out


def cases() -> list[C.Case]:
    return (_megatron_2021() + _sequence_parallel_2021() + _alpa() + _llm_foundry() + _torchtitan()
            + _megatron_core_h100() + _megatron_bridge())
