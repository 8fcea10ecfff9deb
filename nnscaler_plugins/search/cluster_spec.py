"""What the cost model knows about a cluster, as plain data: `ClusterSpec` (devices per node, peak
FLOP/s per dtype, memory and its bandwidth per device), one `Link` per level of the network, and
their YAML/JSON form. The presets and the `cluster()` factory live in `cluster.py`; the measured
`local-cpu` spec is built by `calibrate.py`, which needs only this module.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional

from nnscaler_plugins.search.efficiency import GPU_EFFICIENCY, Efficiency
from nnscaler_plugins.search.kernel_tables import KernelTable, kernel_table

GiB = 1024 ** 3


class ClusterError(ValueError):
    """A cluster name or file that cannot be used; the message says what to pass instead."""


@dataclass(frozen=True)
class Link:
    """One level of the network.

    `bandwidth` is bytes/s in each direction. With `per_node` it is the node's total (all its
    network cards together), shared by every device of the node that talks across nodes at once,
    as the 25 Gbps of a p3.16xlarge is; otherwise each device has that bandwidth to itself (NVLink
    and NVSwitch ports). `latency` is the alpha of the alpha-beta model: seconds per message.
    """

    name: str
    bandwidth: float
    latency: float
    per_node: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Link":
        return cls(str(d["name"]), float(d["bandwidth"]), float(d["latency"]), bool(d.get("per_node", False)))


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    devices_per_node: int
    device: str
    peak_flops: Mapping[str, float]  # dtype name ("bf16", "fp16", "fp32") -> FLOP/s per device
    memory_bytes: float  # per device
    memory_bandwidth: float  # bytes/s per device (HBM, or DRAM for CPUs)
    intra_node: Link
    inter_node: Link
    dtype: str = "bf16"  # the training precision plans are costed in unless a plan says otherwise
    efficiency: Efficiency = field(default_factory=lambda: GPU_EFFICIENCY)
    notes: str = ""
    # Per-kernel efficiencies of the device class (search/kernel_tables.py); None: the two constants of
    # `efficiency` (matmul, memory) price every kernel alike.
    kernels: Optional[KernelTable] = None
    # The host side, for offload (search/offload_cost.py): host memory per node, bytes/s between the
    # host and each device in each direction (PCIe), the host's memory bandwidth per node (a CPU
    # optimizer step); 0 where not known.
    host_memory_bytes: float = 0.0
    host_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ClusterError(f"cluster {self.name!r}: nodes and devices_per_node must be >= 1 "
                               f"(got {self.nodes}, {self.devices_per_node})")
        if self.dtype not in self.peak_flops:
            raise ClusterError(f"cluster {self.name!r}: no peak FLOP/s for its training dtype {self.dtype!r} "
                               f"(peak_flops has {sorted(self.peak_flops)})")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def __hash__(self) -> int:
        return hash((self.name, self.nodes, self.devices_per_node, self.device, tuple(sorted(self.peak_flops.items())),
                     self.memory_bytes, self.memory_bandwidth, self.intra_node, self.inter_node, self.dtype,
                     self.efficiency, self.kernels))

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def flops(self, dtype: Optional[str] = None) -> float:
        dtype = dtype or self.dtype
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ClusterError(f"cluster {self.name!r} has no peak FLOP/s for {dtype!r} "
                               f"(it knows {sorted(self.peak_flops)})") from None

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        return replace(self, nodes=int(nodes))

    def describe(self) -> str:
        peak = ", ".join(f"{k} {_rate(v)}" for k, v in sorted(self.peak_flops.items()))
        inter = f"{self.inter_node.bandwidth / 1e9:.1f} GB/s{' per node' if self.inter_node.per_node else ''}"
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device} "
                f"({peak}; {self.memory_bytes / GiB:.1f} GiB at {self.memory_bandwidth / 1e9:.0f} GB/s); "
                f"in-node {self.intra_node.name} {self.intra_node.bandwidth / 1e9:.1f} GB/s, "
                f"across nodes {self.inter_node.name} {inter}")

    # -- files ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "device": self.device, "peak_flops": dict(self.peak_flops), "memory_bytes": self.memory_bytes,
                "memory_bandwidth": self.memory_bandwidth, "intra_node": self.intra_node.to_json(),
                "inter_node": self.inter_node.to_json(), "dtype": self.dtype,
                "efficiency": self.efficiency.to_json(), "notes": self.notes,
                "host_memory_bytes": self.host_memory_bytes, "host_bandwidth": self.host_bandwidth,
                "host_memory_bandwidth": self.host_memory_bandwidth,
                **({"kernels": self.kernels.name if self.kernels.name and not self.kernels.name.endswith(".json")
                    else self.kernels.to_json()} if self.kernels is not None else {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str = "") -> "ClusterSpec":
        where = f" in {source}" if source else ""
        required = ("name", "nodes", "devices_per_node", "peak_flops", "memory_bytes", "memory_bandwidth",
                    "intra_node", "inter_node")
        missing = [k for k in required if k not in d]
        if missing:
            raise ClusterError(f"cluster spec{where} lacks {', '.join(missing)}; see nnscaler_plugins/search/cluster.py "
                               "for an example file")
        try:
            return cls(name=str(d["name"]), nodes=int(d["nodes"]), devices_per_node=int(d["devices_per_node"]),
                       device=str(d.get("device", "device")),
                       peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
                       memory_bytes=float(d["memory_bytes"]), memory_bandwidth=float(d["memory_bandwidth"]),
                       intra_node=Link.from_json(d["intra_node"]), inter_node=Link.from_json(d["inter_node"]),
                       dtype=str(d.get("dtype", "bf16")),
                       efficiency=Efficiency.from_json(d["efficiency"]) if "efficiency" in d else GPU_EFFICIENCY,
                       notes=str(d.get("notes", "")),
                       host_memory_bytes=float(d.get("host_memory_bytes", 0.0)),
                       host_bandwidth=float(d.get("host_bandwidth", 0.0)),
                       host_memory_bandwidth=float(d.get("host_memory_bandwidth", 0.0)),
                       kernels=(kernel_table(d["kernels"]) if isinstance(d["kernels"], str)
                                else KernelTable.from_json(d["kernels"])) if d.get("kernels") else None)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ClusterError):
                raise
            raise ClusterError(f"cluster spec{where} is malformed: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write YAML for .yaml/.yml paths, JSON otherwise."""
        path = os.fspath(path)
        data = self.to_json()
        with open(path, "w") as f:
            if path.endswith((".yaml", ".yml")):
                import yaml
                yaml.safe_dump(data, f, sort_keys=False)
            else:
                json.dump(data, f, indent=1)
                f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSpec":
        path = os.fspath(path)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ClusterError(f"cannot read cluster file {path}: {e.strerror}") from None
        try:
            if path.endswith((".yaml", ".yml")):
                import yaml
                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:  # noqa: BLE001 - yaml and json raise different types
            raise ClusterError(f"cluster file {path} is not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {e}") from None
        if not isinstance(data, dict):
            raise ClusterError(f"cluster file {path} must hold a mapping of cluster fields")
        return cls.from_json(data, source=path)


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"
