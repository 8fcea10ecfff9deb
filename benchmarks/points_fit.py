"""The fit set: the only published points the cost model's fitted constants see.

`simulator_fidelity.py --fit` fits one number per software stack on these rows, `Efficiency.sustained`
(the fraction of the kernel tables' speed whole training steps of that software reach; search/cluster.py
`SUSTAINED_2021`, `SUSTAINED_CURRENT`), and nothing else. Every other published point is in
`points_report.py` and is only ever evaluated. A row moves between the two files only with a new fit
and a dated note in RESULTS.md.

2021 stack (Megatron-LM as in its 2021 papers, A100): four rows of Narayanan et al., SC'21, Table 1
(github.com/NVIDIA/Megatron-LM, README "cases_april2021.png", and arXiv 2104.04473): a small
data-parallel model, a tensor-parallel-only one, and two deep pipelines.

Current stack (2023-2024 software): three llm-foundry rows, FSDP with FlashAttention in eager PyTorch
(github.com/mosaicml/llm-foundry, scripts/train/benchmarking/README.md, tables "H100 80GB BF16" and
"A100 80GB with 1600 Gbps node-node interconnect (RoCE)").
"""
from __future__ import annotations

import calibration as C

MEGATRON_2021 = "github.com/NVIDIA/Megatron-LM README (images/cases_april2021.png); Narayanan et al. SC'21 Table 1"
LLM_FOUNDRY = "github.com/mosaicml/llm-foundry scripts/train/benchmarking/README.md"


def cases() -> list[C.Case]:
    # Megatron-LM PTD-P (source: MEGATRON_2021): name, h, l, heads, tp, pp, GPUs, batch, step time derived
    # from the published TFLOP/s per GPU (137, 135, 148, 163)
    out = [C.megatron_2021("1.7B", 2304, 24, 24, 1, 1, 32, 512, 3.53, fit=True),
           C.megatron_2021("18B", 6144, 40, 48, 8, 1, 256, 1024, 9.40, fit=True),
           C.megatron_2021("145B", 12288, 80, 96, 8, 8, 1536, 2304, 24.82, fit=True),
           C.megatron_2021("1T", 25600, 128, 160, 8, 64, 3072, 3072, 102.6, fit=True)]
    # llm-foundry (source: LLM_FOUNDRY): GPU table, model, seq, GPUs, micro-batch, grad accumulation,
    # global batch, activation checkpointing, tokens/s/GPU
    out += [C.llm_foundry("H100", "7b", 2048, 8, 6, 1, 48, False, 10643, fit=True),
            C.llm_foundry("H100", "30b", 2048, 32, 14, 3, 1344, True, 2308, fit=True),
            C.llm_foundry("A100", "7b", 2048, 8, 6, 2, 96, False, 4641, fit=True)]
    return out
