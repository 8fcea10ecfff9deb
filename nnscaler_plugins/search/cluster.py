"""Cluster specs: what the cost model knows about the machines a plan will run on.

A `ClusterSpec` is plain data: devices per node, peak FLOP/s per dtype, memory and memory bandwidth
per device, and one `Link` per level of the network (inside a node, across nodes). It is saved and
loaded as a small YAML or JSON file, so a user describes their own cluster without code:

    name: my-cluster
    nodes: 4
    devices_per_node: 8
    device: A100-80GB
    peak_flops: {bf16: 312e12, fp16: 312e12, fp32: 19.5e12}
    memory_bytes: 85899345920
    memory_bandwidth: 2.039e12
    intra_node: {name: nvswitch, bandwidth: 300e9, latency: 5e-6}
    inter_node: {name: hdr-infiniband, bandwidth: 200e9, latency: 10e-6, per_node: true}

Bandwidths are the hardware's nominal numbers; how much of them (and of the peak FLOP/s and the
memory bandwidth) a real kernel reaches is `Efficiency`, the only constants the cost model fits
(see `nnscaler_plugins/search/efficiency.py` and the section "Fitted constants" there).

The presets are the clusters the calibration points were measured on (docs/cost-model.md):
`v100-p3` (p3.16xlarge: 8 x V100-16GB, NVLink, 25 Gbps per node), `a100-dgx` (8 x A100-80GB on
NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node), `h100-dgx` (8 x H100-80GB, NVLink4, 8 x 400 Gb/s
per node), `h200` (8 x H200-141GB, the H100's compute and network with HBM3e at 4.8 TB/s), and
`local-cpu`, which measures the machine it runs on (see `calibrate.py`). Each GPU preset carries its
device class's kernel table (`search/kernel_tables.py`) and the software stack it assumes
(`STACK_2021` for V100 and A100, as the papers they are calibrated on; `STACK_CURRENT` for Hopper).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from nnscaler_plugins.search.cluster_spec import ClusterError, ClusterSpec, GiB, Link  # noqa: F401 - the spec types are this module's API too
from nnscaler_plugins.search.efficiency import GPU_EFFICIENCY
from nnscaler_plugins.search.kernel_tables import kernel_table

# The software stacks the presets assume (what each overlaps: search/overlap.py). `sustained` is the one
# fitted number of a stack (benchmarks/simulator_fidelity.py --fit fits each on its own calibration rows and
# holds the others out): the fraction of the kernel tables' speed whole steps of that software reach.
SUSTAINED_2021 = 0.82
SUSTAINED_CURRENT = 0.80
# Megatron-LM as in the 2021 papers the A100 and V100 calibration points come from (CUDA 11.0 era): gradient
# all-reduce in buckets during the backward, pipeline p2p beside compute, tensor-parallel collectives
# synchronous, attention written out as matmuls and a fused softmax.
# Element-wise chains: as this runtime's generated code runs them, one kernel per op unless the plan is
# compiled (compile=True prices them fused, search/costmodel.py); a published run's own stack says whether
# it fused them (Megatron's hand-fused kernels, XLA: benchmarks/calibration.py).
STACK_2021 = replace(GPU_EFFICIENCY, sustained=SUSTAINED_2021, tp_comm_overlap=False, attention_kernel="flash2",
                     fused_elementwise=False)
# Megatron-Core / torchtitan / FSDP today: tp-comm-overlap or async TP (else backward tensor-parallel collectives
# issued asynchronously beside the weight-gradient matmuls), distributed-optimizer / FSDP overlap
# of reduce-scatter and all-gather, flash attention (cuDNN / FlashAttention-3 class on Hopper).
STACK_CURRENT = replace(GPU_EFFICIENCY, sustained=SUSTAINED_CURRENT, tp_comm_overlap=True, tp_backward_overlap=True,
                        attention_kernel="flash3", fused_attention=True, fused_elementwise=False)


# -- presets -----------------------------------------------------------------------------------------------
def _v100_p3(nodes: int) -> ClusterSpec:
    return ClusterSpec(
        name="v100-p3", nodes=nodes, devices_per_node=8, device="V100-SXM2-16GB",
        peak_flops={"fp16": 125e12, "bf16": 125e12, "fp32": 15.7e12},
        memory_bytes=16 * GiB, memory_bandwidth=900e9,
        # p3.16xlarge: NVLink 2 hybrid cube-mesh, 6 links x 25 GB/s per GPU (not every pair is
        # directly linked, so a ring reaches about what 6 links give one GPU).
        intra_node=Link("nvlink2", 150e9, 8e-6),
        inter_node=Link("ethernet-25gbps", 25e9 / 8, 30e-6, per_node=True),
        dtype="fp16", notes="AWS p3.16xlarge, as in Alpa's benchmarks",
        efficiency=STACK_2021, kernels=kernel_table("v100"),
        # 488 GiB host memory, PCIe gen3 x16 (about 12 GB/s achieved), 2 x Xeon E5-2686 v4 (4 x DDR4-2400 each)
        host_memory_bytes=488 * GiB, host_bandwidth=12e9, host_memory_bandwidth=2 * 76.8e9)


def _a100_dgx(nodes: int) -> ClusterSpec:
    return ClusterSpec(
        name="a100-dgx", nodes=nodes, devices_per_node=8, device="A100-SXM4-80GB",
        peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        memory_bytes=80 * GiB, memory_bandwidth=2.039e12,
        intra_node=Link("nvswitch3", 300e9, 6e-6),
        inter_node=Link("hdr-infiniband", 8 * 200e9 / 8, 10e-6, per_node=True),
        dtype="bf16", notes="DGX A100 80GB (Selene): NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node",
        efficiency=STACK_2021, kernels=kernel_table("a100"),
        # 2 TB host memory, PCIe gen4 x16 (about 25 GB/s achieved), 2 x EPYC 7742 (8 x DDR4-3200 each)
        host_memory_bytes=2e12, host_bandwidth=25e9, host_memory_bandwidth=2 * 204.8e9)


def _h100_dgx(nodes: int) -> ClusterSpec:
    return ClusterSpec(
        name="h100-dgx", nodes=nodes, devices_per_node=8, device="H100-SXM5-80GB",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12, "fp32": 67e12},
        memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
        intra_node=Link("nvlink4", 450e9, 5e-6),
        inter_node=Link("ndr-infiniband", 8 * 400e9 / 8, 10e-6, per_node=True),
        dtype="bf16", notes="DGX H100: NVLink4/NVSwitch, 8 x 400 Gb/s NDR InfiniBand per node",
        efficiency=STACK_CURRENT, kernels=kernel_table("h100"),
        # 2 TB host memory, PCIe gen5 x16 (about 50 GB/s achieved), 2 x Xeon 8480C (8 x DDR5-4800 each)
        host_memory_bytes=2e12, host_bandwidth=50e9, host_memory_bandwidth=2 * 307.2e9)


def _h200(nodes: int) -> ClusterSpec:
    return ClusterSpec(
        name="h200", nodes=nodes, devices_per_node=8, device="H200-SXM-141GB",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12, "fp32": 67e12},
        memory_bytes=141e9, memory_bandwidth=4.8e12,
        intra_node=Link("nvlink4", 450e9, 5e-6),
        inter_node=Link("ndr-infiniband", 8 * 400e9 / 8, 10e-6, per_node=True),
        dtype="bf16", notes="HGX/DGX H200: the H100's compute with 141 GB HBM3e at 4.8 TB/s; NVLink4/NVSwitch, "
                            "8 x 400 Gb/s NDR InfiniBand per node",
        efficiency=STACK_CURRENT, kernels=kernel_table("h200"),
        host_memory_bytes=2e12, host_bandwidth=50e9, host_memory_bandwidth=2 * 307.2e9)  # as the DGX H100


PRESETS = {"v100-p3": _v100_p3, "a100-dgx": _a100_dgx, "h100-dgx": _h100_dgx, "h200": _h200}
LOCAL = "local-cpu"


def cluster(name: str | os.PathLike, nodes: Optional[int] = None, *, devices: Optional[int] = None,
            measure: bool = True, cache_dir: Optional[str] = None) -> ClusterSpec:
    """A cluster by preset name or from a YAML/JSON file.

    Presets: "v100-p3", "a100-dgx", "h100-dgx", "h200" (`nodes` of 8 devices each, default 1) and
    "local-cpu": this machine, `devices` processes on one node (default: one per CPU core), with
    matmul throughput, memory bandwidth and gloo bandwidth and latency measured once and cached
    under `cache_dir` (default ~/.cache/nnscaler-plugins); `measure=False` skips the measurement
    and uses conservative defaults (deterministic, for tests).
    """
    text = os.fspath(name)
    if text == LOCAL:
        from nnscaler_plugins.search.calibrate import local_cpu
        spec = local_cpu(devices=devices, measure=measure, cache_dir=cache_dir)
        return spec.with_nodes(nodes) if nodes is not None else spec
    if text in PRESETS:
        spec = PRESETS[text](int(nodes) if nodes is not None else 1)
        if devices is not None:
            raise ClusterError(f"preset {text!r} has 8 devices per node; choose nodes= instead of devices=")
        return spec
    if os.path.exists(text) or text.endswith((".yaml", ".yml", ".json")):
        spec = ClusterSpec.load(text)
        if nodes is not None:
            spec = spec.with_nodes(nodes)
        if devices is not None:
            spec = replace(spec, devices_per_node=int(devices))
        return spec
    known = ", ".join(list(PRESETS) + [LOCAL])
    raise ClusterError(f"unknown cluster {text!r}: use a preset ({known}) or the path of a YAML/JSON cluster file")


def presets() -> list[str]:
    return list(PRESETS) + [LOCAL]
