"""The constants of the cost model, and what the software stack a cluster runs does.

Everything else the simulator uses is either read off the graph (FLOPs, bytes, which tensors the
backward keeps), a nominal hardware number from the cluster spec (peak FLOP/s, memory bandwidth,
link bandwidth and latency) or, for clusters with a kernel table (`ClusterSpec.kernels`, every GPU
preset), the table's per-kernel efficiencies (search/kernel_tables.py). What is left:

- `sustained` (FITTED, with a kernel table): the fraction of the table's kernel-benchmark speed that
  whole training steps of the stack reach. One number per stack, shared by every device:
  `benchmarks/simulator_fidelity.py --fit` fits each stack's on the rows of `benchmarks/points_fit.py`
  (four Megatron-LM rows for the 2021 stack, three llm-foundry rows for today's) and never on the
  rows of `benchmarks/points_report.py`, which it reports.
- `matmul`, `memory` (for clusters without a table, e.g. a user's file): the fractions of peak
  FLOP/s and of memory bandwidth every matmul and every memory-bound op reach.
- `network` (set, 0.8): the fraction of a link's nominal bandwidth that collectives reach (NCCL's bus
  bandwidth over the wire speed is about that on NVSwitch and InfiniBand).
- `op_overhead_s` (set, 5 us): the fixed cost of launching one kernel. `view_overhead_s` (0 on GPUs,
  where the host queues views while kernels run): the cost of a view op, which on CPU processes in
  eager PyTorch is a dispatch like any other, forward and backward (`local-cpu` measures both).
- `overlap_slowdown` (from the literature, 1.15): the factor by which compute and communication slow
  each other down when they overlap (Galvatron's documentation gives 1.1 to 1.3).

Properties of the software, not constants: whether element-wise chains run fused (`fused_elementwise`:
Megatron's hand-fused kernels, torch.compile; off for eager PyTorch and the local CPU preset), whether
attention written out is run as one flash kernel (`fused_attention`) and which flash family
(`attention_kernel`), whether communication can run beside compute at all (`comm_overlap`: not for
gloo processes on CPU cores), the four overlap switches a plan may override (search/overlap.py),
whether the backward's tensor-parallel collectives run beside the weight-gradient matmuls
(`tp_backward_overlap`), whether a saved all-gathered input is kept as a shard and gathered again
(`regather_saved_inputs`: this runtime and Megatron) or kept whole (PyTorch DTensor), and how ZeRO-3
gathers weights (`zero3_gather`: held one weight at a time here, a layer at a time in FSDP).
The presets' stacks are in search/cluster.py (`STACK_2021`, `STACK_CURRENT`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Efficiency:
    matmul: float = 0.6
    memory: float = 0.8
    network: float = 0.8
    op_overhead_s: float = 5e-6
    overlap_slowdown: float = 1.15
    view_overhead_s: float = 0.0
    # Whether chains of element-wise ops run as one kernel (Megatron's hand-fused kernels, torch.compile,
    # XLA) or one kernel per op (eager PyTorch). Not fitted: a property of the software that runs the plan.
    # Such a stack also keeps less for backward: a hand-fused kernel recomputes its chain's intermediates
    # from tensors kept anyway (an RMSNorm's normalized copy, a SwiGLU's activation; `OpCost.saved_fused`).
    # A compiled plan's saves are priced as eager: what inductor's partitioner keeps is its own choice.
    fused_elementwise: bool = True
    # Whether communication runs beside compute (GPUs: copy engines and NICs) or takes the same cores
    # (gloo between processes on CPU cores): then gradient reduction adds to the step instead of hiding.
    comm_overlap: bool = True
    # With a kernel table (`ClusterSpec.kernels`): the fraction of the table's kernel-benchmark speed a whole
    # training step sustains, for every kernel (FITTED, one number for every device: clocks under hours of
    # full power draw are below a microbenchmark's boost clocks, and a step has gaps between kernels that a
    # benchmark timing one kernel back to back has not).
    sustained: float = 1.0
    # The flash-attention kernel family the stack runs ("flash3": cuDNN / FlashAttention-3 class on Hopper,
    # as Megatron-Core with Transformer Engine; "flash2": FlashAttention-2 class, as PyTorch SDPA); "" the
    # table's first.
    attention_kernel: str = ""
    # Whether the stack runs attention written out as matmuls and a softmax (an "attention core") as one
    # flash kernel (Megatron-Core with Transformer Engine does; 2021 Megatron-LM did not): the core's
    # matmuls are priced at the flash table's efficiency, its element-wise ops inside the kernel, and the
    # score matrices are never stored.
    fused_attention: bool = False
    # Overlap the stack does by default (a plan's options of the same names override them; see overlap.py):
    tp_comm_overlap: bool = False  # tensor-parallel collectives pipelined with the neighbouring matmuls
    # Without that pipelining, whether the backward's tensor-parallel collectives are issued asynchronously
    # and run beside the weight-gradient matmuls, which do not need them (Megatron-LM's async tensor-parallel
    # gradient all-reduce / reduce-scatter since late 2021; PyTorch DTensor's asynchronous collectives, waited
    # for at first use). A property of the software stack, not a plan option.
    tp_backward_overlap: bool = False
    overlap_grad_reduce: bool = True  # gradient reduce(-scatter) in buckets during the backward
    overlap_param_gather: bool = True  # ZeRO weight all-gathers prefetched under the forward / backward
    overlap_p2p: bool = True  # pipeline sends and receives asynchronous, beside compute
    # Whether an all-gathered input that a column-split matmul saves for backward is kept as this device's
    # shard and gathered again in backward, its gradient reduce-scattered (this runtime, Megatron-LM's
    # sequence parallelism: less memory, one more all-gather), or kept whole with its gradient only
    # reduce-scattered (PyTorch DTensor's sequence parallelism as torchtitan runs it).
    regather_saved_inputs: bool = True
    # How ZeRO-3 gathers weights: "param" (this runtime: a layer's weights travel in one collective, but each
    # is dropped after the code's last use of it and gradients leave in reduce buckets, so what it holds is
    # priced per weight; tests/test_memory_priced_vs_measured.py holds it within 10 %) or "module" (FSDP / FSDP2 wrapping each layer: a layer's weights whole at once, the next
    # layer's prefetched beside them, and in backward their gradients whole until reduce-scattered).
    zero3_gather: str = "param"
    # Whether a compiled plan's loss is compiled too (this runtime compiles the whole per-rank program;
    # torchtitan compiled only the transformer blocks until 2025): its fused kernel keeps the logits in the
    # training dtype instead of their fp32 upcast and log-probabilities (search/costmodel.py `_loss_bytes`).
    compiled_loss: bool = True
    # Whether a float8 product keeps its activation input for backward as float8 (Transformer Engine, as
    # Megatron-Core runs it: the cast input and its transpose) or in the training dtype, cast again in
    # backward (torchao's Float8Linear, as torchtitan runs it).
    fp8_saves_float8: bool = False
    # Bytes per parameter of the gradients the stack accumulates and reduces: 0 prices the plan's own
    # (this runtime's fp32 main gradients, `Training.grad_bytes`); 2 for a stack that keeps them in bf16
    # (Megatron-Core with `grad_reduce_in_fp32=False`, as Megatron-Bridge's fine-tuning recipes set it).
    main_grad_bytes: int = 0
    # Whether an eager loss over vocabulary-split logits runs as PyTorch DTensor's `loss_parallel` (torchtitan
    # with tensor parallelism): its backward (`_nll_loss_and_log_softmax_backward`) holds a zeroed one-hot
    # gradient, the log-probabilities' exponential and their sum beside the saved log-probabilities, one
    # logits-sized fp32 tensor more than a fused cross-entropy backward (search/costmodel.py `_working_set`).
    loss_parallel_written_out: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Efficiency":
        def conv(k: str, v: Any) -> Any:
            kind = cls.__dataclass_fields__[k].type
            if kind in ("bool", bool):
                return bool(v)
            if kind in ("str", str):
                return str(v)
            if kind in ("int", int):
                return int(v)
            return float(v)
        return cls(**{k: conv(k, v) for k, v in d.items() if k in cls.__dataclass_fields__})


GPU_EFFICIENCY = Efficiency(matmul=0.75, memory=0.6, network=0.8, op_overhead_s=5e-6)
