"""The constants of the cost model: how much of the hardware's nominal numbers real kernels reach.

Everything else the simulator uses is either read off the graph (FLOPs, bytes, which tensors the
backward keeps) or a nominal hardware number from the cluster spec (peak FLOP/s, memory bandwidth,
link bandwidth and latency). What is left are these physical constants:

- `matmul` (FITTED): the fraction of peak FLOP/s that large matrix multiplications reach (cuBLAS on
  transformer-sized GEMMs, including the tile and wave quantization they lose on average).
- `memory` (FITTED): the fraction of memory bandwidth that memory-bound kernels (element-wise ops,
  norms, softmax, the optimizer update) reach.
- `network` (set, 0.8): the fraction of a link's nominal bandwidth that collectives reach (NCCL's bus
  bandwidth over the wire speed is about that on NVSwitch and InfiniBand).
- `op_overhead_s` (set, 5 us): the fixed cost of launching one kernel.
- `overlap_slowdown` (from the literature, 1.15): the factor by which compute and communication slow
  each other down when they overlap (Galvatron's documentation gives 1.1 to 1.3).

Fusion of element-wise chains (`fused_elementwise`) is a property of the software that runs the plan,
not a constant: on for the GPU presets (the calibration points ran fused kernels), off for the local
CPU preset (the generated code runs eager PyTorch ops).

How the two fitted constants were fitted: one grid search (matmul 0.60-0.80, memory 0.5-0.8, step
0.05 / 0.1) minimising the mean absolute percentage error of the step times of the C1 and C2
calibration points of docs/cost-model.md together (A100 rows, published configurations
written with the `megatron` strategy); `benchmarks/simulator_fidelity.py --fit` repeats it. Nothing is
fitted per row, and C3 (V100, Alpa) is not used in the fit: it is a check. The local CPU preset fits
nothing: it measures its throughputs directly (`calibrate.py`), so its efficiencies are 1 relative to
the measured numbers.
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
    # Whether chains of element-wise ops run as one kernel (Megatron's hand-fused kernels, torch.compile,
    # XLA) or one kernel per op (eager PyTorch). Not fitted: a property of the software that runs the plan.
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
    overlap_grad_reduce: bool = True  # gradient reduce(-scatter) in buckets during the backward
    overlap_param_gather: bool = True  # ZeRO weight all-gathers prefetched under the forward / backward
    overlap_p2p: bool = True  # pipeline sends and receives asynchronous, beside compute

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
            return float(v)
        return cls(**{k: conv(k, v) for k, v in d.items() if k in cls.__dataclass_fields__})


GPU_EFFICIENCY = Efficiency(matmul=0.75, memory=0.6, network=0.8, op_overhead_s=5e-6)
