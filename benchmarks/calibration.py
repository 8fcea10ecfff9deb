"""Published training runs as models and the plans they were run with: the machinery shared by the
point files and the benchmarks that use them.

The points themselves live in two files, kept apart on purpose:
- `points_fit.py`: the few rows the cost model's fitted constants (`Efficiency.sustained`, one per
  software stack) are fitted on by `simulator_fidelity.py --fit`, and nothing else;
- `points_report.py`: every other row; the simulator is only evaluated on them, never fitted.
Each row there carries its source (URL or repository and path) beside its numbers.

A case is the published configuration written with the `megatron` strategy's options (FSDP as tp=1,
zero=3), on the cluster preset of the run's device with the run's own hardware and software facts
(`Case.hardware`, `Case.stack`), and one captured micro-batch of an HF model of the published shape:
GPT-2 graphs for Megatron-LM and MPT runs (GeLU MLP, attention written out for Megatron's own kernels,
scaled_dot_product_attention for FlashAttention runs), Llama graphs for torchtitan runs. Shared by
simulator_fidelity.py (does the simulator reproduce the published numbers?) and plan_quality.py
(does the search beat the published plans?).
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
    # whose peak the published figure is: "max", the largest over the ranks; "last", the last global rank's
    # (a run that logged memory through its metrics writer, which lives on the last rank: the last
    # pipeline stage)
    peak_rank: str = "max"

    @property
    def dp(self) -> int:
        return self.world // (self.options.get("tp", 1) * self.options.get("pp", 1))

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.micro_batch * self.dp)


# -- builders the point files write their rows with ---------------------------------------------------
# Megatron-LM / Megatron-Core: hand-fused element-wise kernels (bias-GeLU, scale-mask-softmax,
# bias-dropout-add, fused norms) in eager mode; XLA (Alpa) fuses them too. The presets' stacks price this
# runtime's generated code, one kernel per op unless compiled.
MEGATRON_STACK = {"fused_elementwise": True}


def megatron_2021(name: str, h: int, l: int, a: int, tp: int, pp: int, gpus: int, batch: int, time_s: float,
                  fit: bool = False) -> Case:
    """A Megatron-LM PTD-P row (Narayanan et al., SC'21, Table 1): A100 80GB, s 2048, V 51200, full
    recomputation, micro-batch 1, interleaved 1F1B with the smallest chunk count (2-5) dividing a rank's
    layers. The step time is derived from the published TFLOP/s per GPU (`F_hw / (n X)`)."""
    opts = {"tp": tp, "pp": pp, "recompute": "full"}
    if pp > 1:
        per_rank = l // pp
        v = next((v for v in (2, 3, 4, 5) if per_rank % v == 0), 1)
        opts.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    return Case("C1", name, Model(h, l, a), "a100-dgx", gpus, batch, 1, opts, time_s, stack=dict(MEGATRON_STACK),
                fit=fit)


def sequence_parallel_2021(name: str, h: int, l: int, a: int, tp: int, pp: int, batch: int, b: int, v: int,
                           full_s: float, selective_s: float, states: float, act_none: float, act_sel: float,
                           fit: bool = False) -> list[Case]:
    """A Korthikanti et al. row (Table 5 and Figure 1): full recomputation, sequence parallelism with
    selective recomputation, and no recomputation (memory only)."""
    base = {"tp": tp, "pp": pp}
    if pp > 1:
        base.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    world = tp * pp
    model = Model(h, l, a)
    st = dict(MEGATRON_STACK)
    return [Case("C2 full", name, model, "a100-dgx", world, batch, b, dict(base, recompute="full"), full_s,
                 {"states": states}, stack=st, fit=fit),
            Case("C2 selective", name, model, "a100-dgx", world, batch, b,
                 dict(base, recompute="selective", sequence_parallel=True), selective_s, {"activations": act_sel},
                 stack=st, fit=fit),
            Case("C2 no recompute", name, model, "a100-dgx", world, batch, b, dict(base, recompute="none"),
                 None, {"activations": act_none}, stack=st, fit=fit)]


MPT = {"760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32),
       "13b": (5120, 40, 40), "30b": (7168, 48, 64), "70b": (8192, 80, 64)}
# llm-foundry runs: eager PyTorch (no fusion of element-wise chains), FlashAttention-2 class kernels (Triton)
LF_STACK = {"fused_elementwise": False, "attention_kernel": "flash2", "zero3_gather": "module"}


def llm_foundry(gpu: str, size: str, s: int, gpus: int, mb: int, ga: int, gbs: int, ac: bool, tps: float,
                fit: bool = False) -> Case:
    """An llm-foundry MPT row: FSDP FULL_SHARD, FlashAttention, eager PyTorch; MPT shapes (vocabulary
    50368, MLP 4x) as GPT-2 graphs with scaled_dot_product_attention. Step time = global batch tokens /
    (tokens/s/GPU x GPUs)."""
    h, l, a = MPT[size]
    if gbs != mb * ga * gpus:
        raise ValueError(f"llm-foundry {size} s{s}: global batch {gbs} != {mb} x {ga} x {gpus}")
    return Case(f"LF-{gpu}", f"{size} s{s} {gpus} GPUs", Model(h, l, a, s=s, V=50368, arch="gpt2-sdpa", dropout=0.0),
                "h100-dgx" if gpu == "H100" else "a100-dgx", gpus, gbs, mb,
                {"tp": 1, "pp": 1, "zero": 3, "recompute": "full" if ac else "none"},
                gbs * s / (tps * gpus), stack=dict(LF_STACK), fit=fit, era=f"{gpu} current")


LLAMA = {"llama3-8b": Model(4096, 32, 32, s=8192, V=128256, arch="llama", ffn=14336, kv=8),
         "llama3-70b": Model(8192, 80, 64, s=8192, V=128256, arch="llama", ffn=28672, kv=8),
         "llama3.1-405b": Model(16384, 126, 128, s=8192, V=128256, arch="llama", ffn=53248, kv=8),
         "llama2-13b": Model(5120, 40, 40, s=4096, V=32000, arch="llama", ffn=13824, kv=40),
         "llama2-70b": Model(8192, 80, 64, s=4096, V=32000, arch="llama", ffn=28672, kv=8)}
# Grand Teton H100 as torchtitan describes it: 96 GB HBM2e at 2.4 TB/s, 500 W power limit, "peak between SXM
# (989 TFLOP/s) and NVL (835)": the midpoint is taken.
GRAND_TETON = {"memory_bytes": 96e9, "memory_bandwidth": 2.4e12, "peak_flops": {"bf16": 912e12, "fp32": 62e12}}


def torchtitan(source: str, name: str, key: str, gpu: str, gpus: int, local_batch: int, tp: int, recompute: str,
               compiled: bool, async_tp: bool, tps: float, memory_gib: Optional[float] = None,
               fit: bool = False, float8: bool = False, seq: int = 0, compiled_loss: bool = False) -> Case:
    """A torchtitan row: FSDP2 (zero 3 over the data-parallel ranks) x tensor parallelism with sequence
    parallelism (DTensor: a column-parallel matmul keeps its all-gathered input whole for backward), no
    gradient accumulation (the local batch is one micro-batch), PyTorch SDPA (FlashAttention-2 class),
    torch.compile per block or eager, async TP or plain. Step time = local batch x data-parallel
    ranks x sequence / (tokens/s/GPU x GPUs). `recompute`: "selective" for torchtitan's per-op policy
    ("op" here), "full", "none". Memory: torchtitan logs the caching allocator's reserved peak.
    `compiled` is the plan's compile knob (priced as any compiled plan: element-wise chains fused);
    `compiled_loss`: whether that covered the loss (torchtitan's `build_cross_entropy_loss` compiles it
    from 2025; its 2024-12 train.py left it eager, the line commented out).
    `float8`: torchtitan's Float8 rows, torchao's Float8Linear with tensorwise dynamic scaling on every
    nn.Linear but the output projection (`lm_head` here), the plan's precision "fp8"; torchao keeps the
    high-precision (bf16) input of each float8 product for backward and casts it again there, so the
    activations are those of bf16 training. With tensor parallelism torchtitan computes the loss with
    DTensor's `loss_parallel` on vocabulary-split logits (`loss_parallel_written_out`: its backward holds
    one logits-sized fp32 tensor more than a fused cross-entropy's)."""
    model = LLAMA[key] if not seq else replace(LLAMA[key], s=seq)
    dp = gpus // tp
    rc = {"selective": "op"}.get(recompute, recompute)
    opts = {"tp": tp, "pp": 1, "zero": 3, "recompute": rc, **({"sequence_parallel": True} if tp > 1 else {}),
            **({"compile": True} if compiled else {}), **({"precision": "fp8", "fp8_skip": ("lm_head",)} if float8 else {})}
    preset = {"H100": "h100-dgx", "H200": "h200", "A100": "a100-dgx"}[gpu]
    return Case(source, name, model, preset, gpus, local_batch * dp, local_batch,
                opts, local_batch * dp * model.s / (tps * gpus), {"peak": memory_gib} if memory_gib else {},
                stack={"attention_kernel": "flash2", "tp_comm_overlap": async_tp, "compiled_loss": compiled_loss,
                       "regather_saved_inputs": False, "zero3_gather": "module", "loss_parallel_written_out": True},
                hardware=dict(GRAND_TETON) if gpu == "H100" else {}, fit=fit,
                era=f"{'H100' if gpu == 'H200' else gpu} current")


def megatron_core_h100(name: str, a: int, h: int, l: int, tp: int, pp: int, gpus: int, batch: int, tflops: float,
                       fit: bool = False, source: str = "MLM-H100") -> Case:
    """A Megatron-Core GPT row on H100 (Megatron-LM README, 2024): s 4096, V 131072, bf16, distributed
    optimizer (ZeRO-1 over data parallelism) with overlapped gradient reduce-scatter and weight all-gather,
    tp-comm-overlap, sequence parallelism with tp, flash attention (Transformer Engine), no recomputation.
    The micro-batch size is not published: a run without pipeline takes the largest of 4, 2, 1 dividing its
    replica's batch whose activations fit beside the model states (gradient accumulation only costs a tuned
    run), a pipelined one 1, with the smallest interleaving (2-5 chunks) dividing a rank's layers. Step
    time = Megatron's model FLOPs (its `num_floating_point_operations`: 12 B s l h^2 (6 + s/h + V/(2lh)) for
    this GPT) / (GPUs x TFLOP/s per GPU)."""
    s, V = 4096, 131072
    flops = 12 * batch * s * l * h * h * (6 + s / h + V / (2 * l * h))
    opts = {"tp": tp, "pp": pp, "zero": 1, "recompute": "none", **({"sequence_parallel": True} if tp > 1 else {})}
    dp = gpus // (tp * pp)
    mb = 1
    if pp > 1:
        per_rank = l // pp
        v = next((v for v in (2, 3, 4, 5) if per_rank % v == 0), 1)
        opts.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    else:
        mb = next(b for b in (4, 2, 1) if (batch // dp) % b == 0 and
                  _fits_h100(h, l, a, tp, b, s, V, dp))
    return Case(source, name, Model(h, l, a, s=s, V=V), "h100-dgx", gpus, batch, mb, opts,
                flops / (gpus * tflops * 1e12), stack=dict(MEGATRON_STACK), fit=fit, era="H100 current")


def megatron_bridge_llama(name: str, key: str, s: int, tp: int, pp: int, v: int, gpus: int, batch: int,
                          recompute: str, peak_gb: float, fit: bool = False) -> Case:
    """A Megatron-Bridge (Megatron-Core) Llama run on H100 80GB with FP8 (Transformer Engine, current
    scaling): distributed optimizer (ZeRO-1 over data parallelism), sequence parallelism, interleaved
    1F1B with `v` chunks per rank, micro-batch 1, TE's fused element-wise kernels and flash attention;
    every transformer linear in float8 (the output layer not), each keeping its float8 input for
    backward. `recompute` "selective": Megatron's default selective recomputation (the attention core).
    The fine-tuning recipe sets `grad_reduce_in_fp32=False`: gradients are accumulated and reduced in
    bf16 (a stack fact, `main_grad_bytes=2`). Memory only: `peak_gb` is the peak Megatron-Bridge logs,
    in decimal gigabytes (its `report_memory` divides bytes by 1e9), converted here to GiB. It is the
    last global rank's peak: the run's metrics writers (TensorBoard, W&B) live on the last rank, which
    logged its own `torch.cuda.memory_stats()` until Megatron-Bridge reduced them over the pipeline group
    (PR #3645, 2026-05-08, for issue #3167: memory was logged "from last PP rank"). The table was
    measured before that (PR #3107, 2026-04); its baseline ran out of memory on rank 0, the first stage,
    whose interleaved warm-up keeps the most micro-batches, while the logged peak read 58.8 GB."""
    model = replace(LLAMA[key], s=s)
    opts = {"tp": tp, "pp": pp, "zero": 1, "recompute": recompute, "sequence_parallel": tp > 1,
            "schedule": "interleaved" if v > 1 else "1f1b", "virtual_stages": v,
            "precision": "fp8", "fp8_skip": ("lm_head",)}
    return Case("MB-H100 fp8", name, model, "h100-dgx", gpus, batch, 1, opts, None, {"peak": peak_gb * 1e9 / GiB},
                stack=dict(MEGATRON_STACK, fp8_saves_float8=True, main_grad_bytes=2), fit=fit, era="H100 current",
                peak_rank="last")


def _fits_h100(h: int, l: int, a: int, tp: int, b: int, s: int, V: int, dp: int) -> bool:
    """Whether a Megatron GPT micro-batch of `b` fits an 80 GB H100 without recomputation: model states
    (bf16 weights, fp32 gradients, optimizer sharded over `dp`) plus Korthikanti's sequence-parallel
    activations with flash attention (34 s b h / t per layer) and the fp32 logits, with 10 % left over."""
    params = (12 * l * h * h + V * h) / tp
    states = params * (2 + 4 + 12 / dp)
    act = 34 * s * b * h / tp * l + 3 * 4 * s * b * V / tp
    return states + act < 0.9 * 80 * GiB


_GRAPHS: dict = {}


def cases(include_current: bool = True) -> list[Case]:
    """Every point: the fit set (`points_fit.py`, marked `fit`) then the report set (`points_report.py`)."""
    import points_fit
    import points_report

    out = points_fit.cases() + points_report.cases()
    return [c for c in out if include_current or c.era == "2021"]


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
    # what the plan's typed fields and knobs carry, not the strategy's arguments
    compiled, precision, fp8_skip = opts.pop("compile", False), opts.pop("precision", None), opts.pop("fp8_skip", ())
    unit, dp = strategy.degrees(case.world, **opts)
    builder = PlanBuilder(g, unit, dp, strategy="megatron",
                          options={k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool))},
                          micro_batches=case.micro_batches)
    # recompute="op" (torchtitan's per-op checkpointing) is a pricing option only: no recompute groups
    skip = ("zero", "recompute") if opts.get("recompute") == "op" else ("zero",)
    strategy(builder, **{k: v for k, v in opts.items() if k not in skip})
    plan = builder.finish()
    if "zero" in opts:
        plan.zero = opts["zero"]
    if opts.get("recompute") == "op":
        plan.knobs = plan.knobs.replace(recompute="op")
    if compiled:
        plan.knobs = plan.knobs.replace(compile=True)
    if precision:
        plan.precision = precision
        plan.knobs = plan.knobs.replace(fp8_skip=tuple(fp8_skip))
    return plan


def nodes_for(case: Case) -> int:
    return -(-case.world // 8)
