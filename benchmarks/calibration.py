"""The published calibration points, as models and the plans they were run with.

2021 points (docs/cost-model.md: C1 Megatron-LM PTD-P, C2 sequence parallelism, C3 Alpa): an HF GPT-2
model on the meta device with the paper's shape (exact GeLU and attention written out, as Megatron-LM
and Alpa ran it; dropout 0.1 as GPT).

Current-stack points (`current()`), each with its source:
- LF-H100 / LF-A100: MosaicML llm-foundry's MPT training benchmarks (github.com/mosaicml/llm-foundry,
  scripts/train/benchmarking/README.md, tables "H100 80GB BF16" and "A100 80GB with 1600 Gbps
  node-node interconnect (RoCE)"): PyTorch FSDP FULL_SHARD (ZeRO-3), FlashAttention (Triton), eager
  PyTorch. MPT shapes (llm-foundry's yamls: d_model, n_layers, n_heads; vocabulary 50368, MLP 4x,
  checked against the table's parameter counts) as GPT-2 graphs with scaled_dot_product_attention.
  Step time = global batch tokens / (tokens/s/GPU x GPUs).
- TT-H100: torchtitan docs/performance.md (pytorch/torchtitan, commit of 2024-12-26 versions table):
  Llama 3.1 8B with FSDP on 8 and 128 H100 (Grand Teton: 96 GB HBM2e at 2.4 TB/s, 500 W, "peak
  between SXM and NVL", 400 Gb/s per GPU), selective activation checkpointing, with and without
  torch.compile; Llama 3.1 405B FSDP 16 x TP 8 on 128 H100, full checkpointing, bf16 (the earlier
  version of the same page).
- TT-A100: torchtitan docs/performance.md, earlier version: Llama 3 8B / 70B and Llama 2 13B / 70B
  with FSDP on 64 A100 80GB.
Float8 rows are left out (the tables price bf16).

Each case captures one micro-batch and writes the published parallel configuration with the
`megatron` strategy's options (FSDP as tp=1, zero=3). Shared by simulator_fidelity.py (does the
simulator reproduce the published numbers?) and plan_quality.py (does the search beat the published
plans?).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

GiB = 1024 ** 3


@dataclass(frozen=True)
class Model:
    h: int
    l: int
    a: int
    s: int = 2048
    V: int = 51200
    arch: str = "gpt2"  # "gpt2" (attention written out), "gpt2-sdpa" (flash attention), "llama"
    ffn: int = 0  # llama: MLP width
    kv: int = 0  # llama: key/value heads
    dropout: float = 0.1  # GPT-2 / Megatron GPT; MPT and Llama train without dropout

    @property
    def params(self) -> float:
        h, l, V, s = self.h, self.l, self.V, self.s
        return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


@dataclass(frozen=True)
class Case:
    source: str  # "C1", "C2 full", "C2 selective", "C3"
    name: str
    model: Model
    cluster: str
    world: int
    batch: int  # global batch
    micro_batch: int
    options: dict = field(default_factory=dict, hash=False)  # megatron strategy options
    time_s: Optional[float] = None
    memory: dict = field(default_factory=dict, hash=False)  # published memory, GiB: "states", "activations", "peak"
    # what the run's software did (Efficiency fields: fused_elementwise, attention_kernel, ...) and its hardware
    # where it differs from the preset (ClusterSpec fields), both from the source
    stack: dict = field(default_factory=dict, hash=False)
    hardware: dict = field(default_factory=dict, hash=False)
    fit: bool = False  # used to fit `Efficiency.sustained`; every other case is held out
    era: str = "2021"  # "2021", "A100 current", "H100 current"

    @property
    def dp(self) -> int:
        return self.world // (self.options.get("tp", 1) * self.options.get("pp", 1))

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.micro_batch * self.dp)


def _c1() -> list[Case]:
    # (name, h, l, a, tp, pp, gpus, batch, derived t_iter, interleave chunks)
    rows = [("1.7B", 2304, 24, 24, 1, 1, 32, 512, 3.53), ("3.6B", 3072, 30, 32, 2, 1, 64, 512, 3.70),
            ("7.5B", 4096, 36, 32, 4, 1, 128, 512, 3.70), ("18B", 6144, 40, 48, 8, 1, 256, 1024, 9.40),
            ("39B", 8192, 48, 64, 8, 2, 512, 1536, 14.45), ("76B", 10240, 60, 80, 8, 4, 1024, 1792, 16.06),
            ("145B", 12288, 80, 96, 8, 8, 1536, 2304, 24.82), ("310B", 16384, 96, 128, 8, 16, 1920, 2160, 37.61),
            ("530B", 20480, 105, 128, 8, 35, 2520, 2520, 54.08), ("1T", 25600, 128, 160, 8, 64, 3072, 3072, 102.6)]
    out = []
    for name, h, l, a, tp, pp, gpus, batch, t in rows:
        opts = {"tp": tp, "pp": pp, "recompute": "full"}
        if pp > 1:
            per_rank = l // pp
            v = next((v for v in (2, 3, 4, 5) if per_rank % v == 0), 1)
            opts.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
        out.append(Case("C1", name, Model(h, l, a), "a100-dgx", gpus, batch, 1, opts, t))
    return out


def _c2() -> list[Case]:
    # (name, h, l, a, tp, pp, batch, micro-batch, v, full s, selective s, states GiB, act none, act sel)
    rows = [("22B", 6144, 48, 64, 8, 1, 4, 4, 1, 1.42, 1.10, 45.56, 59.25, 9.56),
            ("175B", 12288, 96, 96, 8, 8, 64, 1, 3, 18.13, 13.75, 45.56, 66.84, 12.35),
            ("530B", 20480, 105, 128, 8, 35, 280, 1, 3, 49.05, 37.83, 31.64, 114.02, 23.08),
            ("1T", 25600, 128, 160, 8, 64, 512, 1, 1, 94.42, 71.49, 32.96, 131.25, 26.56)]
    out = []
    for name, h, l, a, tp, pp, batch, b, v, full, sel, states, act_none, act_sel in rows:
        base = {"tp": tp, "pp": pp}
        if pp > 1:
            base.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
        world = tp * pp
        model = Model(h, l, a)
        out.append(Case("C2 full", name, model, "a100-dgx", world, batch, b, dict(base, recompute="full"), full,
                        {"states": states}))
        out.append(Case("C2 selective", name, model, "a100-dgx", world, batch, b,
                        dict(base, recompute="selective", sequence_parallel=True), sel, {"activations": act_sel}))
        out.append(Case("C2 no recompute", name, model, "a100-dgx", world, batch, b, dict(base, recompute="none"),
                        None, {"activations": act_none}))
    return out


def _c3() -> list[Case]:
    # Alpa's manual plan: UniformParallelArgs(prefer_reduce_scatter=True, use_remat=True, dp=2, op=2, pp=2):
    # gradients and optimizer states reduce-scattered over data parallelism (ZeRO-2 style), fp16.
    return [Case("C3", "GPT-2.6B", Model(2560, 32, 32, s=1024), "v100-p3", 8, 32, 4,
                 {"tp": 2, "pp": 2, "recompute": "full", "schedule": "1f1b", "zero": 2}, 2.464, {"peak": 8.745})]


# The 2021 rows the single fitted constant is fitted on (with FIT_CURRENT below); the rest are held out.
FIT_2021 = {("C1", "1.7B"), ("C1", "18B"), ("C1", "145B"), ("C1", "1T")}
FIT_CURRENT = {("LF-H100", "7b s2048 8 GPUs"), ("LF-H100", "30b s2048 32 GPUs"), ("LF-A100", "7b s2048 8 GPUs")}

MPT = {"760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32),
       "13b": (5120, 40, 40), "30b": (7168, 48, 64), "70b": (8192, 80, 64)}
# llm-foundry runs: eager PyTorch (no fusion of element-wise chains), FlashAttention-2 class kernels (Triton)
LF_STACK = {"fused_elementwise": False, "attention_kernel": "flash2"}


def _llm_foundry() -> list[Case]:
    # (GPU table, model, seq, GPUs, micro-batch, grad accumulation, global batch, activation checkpointing, tokens/s/GPU)
    rows = [("H100", "7b", 2048, 8, 6, 1, 48, False, 10643), ("H100", "7b", 4096, 8, 16, 2, 256, True, 8611),
            ("H100", "13b", 2048, 64, 2, 1, 128, False, 4800), ("H100", "13b", 4096, 8, 10, 3, 240, True, 4717),
            ("H100", "30b", 2048, 32, 14, 3, 1344, True, 2308), ("H100", "70b", 2048, 64, 8, 4, 2048, True, 1039),
            ("H100", "3b", 2048, 16, 10, 3, 480, False, 24142), ("H100", "1b", 8192, 8, 3, 4, 96, False, 29157),
            ("H100", "760m", 2048, 16, 24, 1, 384, False, 68551), ("H100", "13b", 16384, 8, 3, 3, 72, True, 2985),
            ("A100", "70b", 2048, 64, 8, 4, 2048, True, 410), ("A100", "30b", 2048, 8, 3, 21, 504, True, 916),
            ("A100", "13b", 2048, 8, 2, 3, 48, False, 2262), ("A100", "13b", 8192, 8, 5, 3, 120, True, 1795),
            ("A100", "7b", 2048, 8, 6, 2, 96, False, 4641), ("A100", "7b", 8192, 8, 8, 2, 128, True, 3206),
            ("A100", "3b", 4096, 8, 5, 6, 240, False, 9457), ("A100", "1b", 2048, 8, 14, 4, 448, False, 20513),
            ("A100", "760m", 8192, 8, 6, 2, 96, False, 20933)]
    out = []
    for gpu, size, s, gpus, mb, ga, gbs, ac, tps in rows:
        h, l, a = MPT[size]
        src = f"LF-{gpu}"
        name = f"{size} s{s} {gpus} GPUs"
        assert gbs == mb * ga * gpus, (size, s, gpus)
        out.append(Case(src, name, Model(h, l, a, s=s, V=50368, arch="gpt2-sdpa", dropout=0.0),
                        "h100-dgx" if gpu == "H100" else "a100-dgx", gpus, gbs, mb,
                        {"tp": 1, "pp": 1, "zero": 3, "recompute": "full" if ac else "none"},
                        gbs * s / (tps * gpus), stack=dict(LF_STACK), fit=(src, name) in FIT_CURRENT,
                        era=f"{gpu} current"))
    return out


LLAMA = {"llama3-8b": Model(4096, 32, 32, s=8192, V=128256, arch="llama", ffn=14336, kv=8),
         "llama3-70b": Model(8192, 80, 64, s=8192, V=128256, arch="llama", ffn=28672, kv=8),
         "llama3.1-405b": Model(16384, 126, 128, s=8192, V=128256, arch="llama", ffn=53248, kv=8),
         "llama2-13b": Model(5120, 40, 40, s=4096, V=32000, arch="llama", ffn=13824, kv=40),
         "llama2-70b": Model(8192, 80, 64, s=4096, V=32000, arch="llama", ffn=28672, kv=8)}
# Grand Teton H100 as torchtitan describes it: 96 GB HBM2e at 2.4 TB/s, 500 W power limit, "peak between SXM
# (989 TFLOP/s) and NVL (835)": the midpoint is taken.
GRAND_TETON = {"memory_bytes": 96e9, "memory_bandwidth": 2.4e12, "peak_flops": {"bf16": 912e12, "fp32": 62e12}}


def _torchtitan() -> list[Case]:
    out = []
    # (name, model, GPUs, local batch, tp, recompute, compiled, tokens/s/GPU, memory GiB)
    h100 = [("8B FSDP 8 GPUs", "llama3-8b", 8, 2, 1, "selective", False, 5762, 82.4),
            ("8B FSDP 8 GPUs compiled", "llama3-8b", 8, 2, 1, "selective", True, 6667, 77.0),
            ("8B FSDP 128 GPUs", "llama3-8b", 128, 2, 1, "selective", False, 5605, 67.0),
            ("8B FSDP 128 GPUs compiled", "llama3-8b", 128, 2, 1, "selective", True, 6514, 62.0),
            ("405B FSDP 16 x TP 8", "llama3.1-405b", 128, 2, 8, "full", False, 109, None)]
    for name, key, gpus, b, tp, rc, compiled, tps, mem in h100:
        model = LLAMA[key]
        dp = gpus // tp
        out.append(Case("TT-H100", name, model, "h100-dgx", gpus, b * dp, b,
                        {"tp": tp, "pp": 1, "zero": 3, "recompute": rc, **({"sequence_parallel": True} if tp > 1 else {})},
                        b * dp * model.s / (tps * gpus), {"peak": mem} if mem else {},
                        stack={"fused_elementwise": compiled, "attention_kernel": "flash2"},
                        hardware=dict(GRAND_TETON), era="H100 current"))
    # 64 A100 80GB, FSDP, torch.compile off: (name, model, local batch, recompute, tokens/s/GPU)
    a100 = [("Llama 3 8B", "llama3-8b", 1, "selective", 2973), ("Llama 3 70B", "llama3-70b", 1, "full", 331),
            ("Llama 2 13B", "llama2-13b", 2, "none", 2162), ("Llama 2 70B", "llama2-70b", 2, "full", 353)]
    for name, key, b, rc, tps in a100:
        model = LLAMA[key]
        out.append(Case("TT-A100", name, model, "a100-dgx", 64, b * 64, b, {"tp": 1, "pp": 1, "zero": 3, "recompute": rc},
                        b * model.s / tps, stack={"fused_elementwise": False, "attention_kernel": "flash2",
                                                  "tp_comm_overlap": True}, era="A100 current"))
    return out


def current() -> list[Case]:
    return _llm_foundry() + _torchtitan()


def cases(include_current: bool = True) -> list[Case]:
    old = [replace(c, fit=(c.source, c.name) in FIT_2021) for c in _c1() + _c2() + _c3()]
    return old + (current() if include_current else [])


_GRAPHS: dict = {}


def graph(model: Model, micro_batch: int, vocab: Optional[int] = None):
    """The captured graph of one micro-batch (cached per shape for the life of the process)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import nnscaler_plugins as nns

    key = (model, micro_batch, vocab)
    if key not in _GRAPHS:
        warnings.filterwarnings("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        if model.arch == "llama":
            cfg = LlamaConfig(hidden_size=model.h, num_hidden_layers=model.l, num_attention_heads=model.a,
                              num_key_value_heads=model.kv or model.a, intermediate_size=model.ffn,
                              vocab_size=vocab or model.V, max_position_embeddings=model.s, use_cache=False)
            cfg._attn_implementation = "sdpa"
            cls = LlamaForCausalLM
        else:
            cfg = GPT2Config(n_layer=model.l, n_embd=model.h, n_head=model.a, vocab_size=vocab or model.V,
                             n_positions=model.s, activation_function="gelu", use_cache=False,
                             resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout)
            cfg._attn_implementation = "sdpa" if model.arch == "gpt2-sdpa" else "eager"
            cls = GPT2LMHeadModel
        with torch.device("meta"):
            m = cls(cfg)
        ids = torch.zeros(micro_batch, model.s, dtype=torch.long, device="meta")
        _GRAPHS.clear()  # one big graph at a time keeps memory flat
        _GRAPHS[key] = nns.capture(m, kwargs={"input_ids": ids, "labels": ids})
    return _GRAPHS[key]


def published_plan(case: Case, g=None):
    """The case's configuration written with the megatron strategy (no lowering: a plan only)."""
    from nnscaler_plugins.plan.primitives import PlanBuilder
    from nnscaler_plugins.plugins import get_strategy

    g = g if g is not None else graph(case.model, case.micro_batch)
    strategy = get_strategy("megatron")
    opts = dict(case.options)
    unit, dp = strategy.degrees(case.world, **opts)
    builder = PlanBuilder(g, unit, dp, strategy="megatron",
                          options={k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool))},
                          micro_batches=case.micro_batches)
    strategy(builder, **{k: v for k, v in opts.items() if k != "zero"})
    plan = builder.finish()
    if "zero" in opts:
        plan.zero = opts["zero"]
    return plan


def nodes_for(case: Case) -> int:
    return -(-case.world // 8)
