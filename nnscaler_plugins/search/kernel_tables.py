"""How fast one device class runs the kernels a training step is made of: `KernelTable`.

Two global constants (a fraction of peak for every matmul, one for every memory-bound op) cannot
price both a 2021 A100 run of hand-written kernels and a 2024 H100 run of flash attention: a GEMM
that fills a few of the 132 SMs of an H100 reaches a small fraction of peak, flash attention's
fraction depends on sequence length and head size, and memory-bound ops move bytes whose count
depends on what the stack fuses. A table holds, per device class, roofline-style curves with a
physical reason for each parameter, and the public (or measured) points they reproduce:

- matmul, per dtype: ``eff = peak_fraction * min(1, tiles / sms) * k / (k + k_half)``. `tiles` are
  the output tiles (``tile_m x tile_n``, times the batch of a batched GEMM) the kernel spreads over
  the device's `sms` streaming multiprocessors: fewer tiles than SMs leave SMs idle. `k_half` is the
  contracted length at which each tile's fixed prologue/epilogue (loading, writing back) costs as
  much as its main loop: short-K GEMMs (attention scores with a head size of 64) reach less.
- attention (flash-style kernels, one op for scores, softmax and values), forward and backward:
  ``eff = peak_fraction * s / (s + s_half) * d / (d + d_half)`` for sequence length s and head size
  d: short sequences give each thread block little work per launch, small heads little work per
  load. The backward fraction is relative to twice the forward FLOPs (what the cost model counts;
  the kernel recomputes the scores, so it reaches less).
- memory-bound ops: ``eff = peak_fraction * bytes / (bytes + bytes_half)`` of the HBM bandwidth
  (kernels moving under a megabyte do not reach it). Which element-wise chains run as one kernel
  (norm + residual, bias + activation, rotary) is `Efficiency.fused_elementwise`.

Tables live as JSON files in ``nnscaler_plugins/search/tables/`` (``a100.json``, ``h100.json``,
``h200.json``, ``v100.json``), each with its sources and the reference points (`points`) its curves
reproduce; `benchmarks/measure_tables.py` measures the same points on a GPU and writes a table in
the same form, with the date and software versions. `tests/test_simulator_tables.py` checks every
shipped table reproduces its own points.
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables")


@dataclass(frozen=True)
class MatmulCurve:
    peak_fraction: float
    k_half: float = 128.0
    tile_m: int = 128
    tile_n: int = 128
    # CPUs: packing the operands costs in proportion to k(m + n) against the m n k of the product, so
    # efficiency falls as 1 / (1 + mn_half (1/m + 1/n)); 0 for GPU tables (their loss is the SM fill).
    mn_half: float = 0.0
    # CPUs: a product whose operands and result fit in the cache (`KernelTable.cache_bytes`) runs this much
    # faster than one streaming them from DRAM; 1 for GPU tables.
    cache_speedup: float = 1.0

    def efficiency(self, m: float, n: float, k: float, batch: float, sms: int, cache_bytes: float = 0.0,
                   itemsize: int = 4) -> float:
        m, n = max(m, 1.0), max(n, 1.0)
        tiles = math.ceil(m / self.tile_m) * math.ceil(n / self.tile_n) * max(batch, 1.0)
        fill = min(1.0, tiles / max(sms, 1))
        packing = 1.0 / (1.0 + self.mn_half * (1.0 / m + 1.0 / n))
        eff = self.peak_fraction * fill * packing * k / (k + self.k_half)
        if self.cache_speedup != 1.0 and cache_bytes > 0:
            eff *= cached(self.cache_speedup, (m * k + k * n + m * n) * itemsize, cache_bytes)
        return eff


def cached(speedup: float, nbytes: float, cache_bytes: float) -> float:
    """Throughput factor of a working set of `nbytes`: `speedup` well inside the cache, 1 well outside."""
    return 1.0 + (speedup - 1.0) / (1.0 + (nbytes / cache_bytes) ** 2)


@dataclass(frozen=True)
class AttentionCurve:
    forward: float
    backward: float
    s_half: float = 256.0
    d_half: float = 24.0
    causal_fraction: float = 0.9  # a causal kernel skips half the tiles but loses some balance doing so

    def efficiency(self, seq: float, head_dim: float, backward: bool, causal: bool) -> float:
        base = self.backward if backward else self.forward
        eff = base * seq / (seq + self.s_half) * head_dim / (head_dim + self.d_half)
        return eff * (self.causal_fraction if causal else 1.0)


@dataclass(frozen=True)
class KernelTable:
    """Kernel efficiencies of one device class (see the module docstring for the curves)."""

    device: str
    sms: int
    matmul: Mapping[str, MatmulCurve]
    attention: Mapping[str, AttentionCurve] = field(default_factory=dict)  # by kernel: "flash2", "flash3"
    memory_fraction: float = 0.8
    memory_bytes_half: float = 1.0e6
    # CPUs: element-wise ops on tensors that fit in the cache run `cache_speedup` times the DRAM rate
    cache_bytes: float = 0.0
    cache_speedup: float = 1.0
    sources: tuple = ()
    points: tuple = ()  # reference points as dicts: {"kind", shape fields, "dtype", "efficiency", "source"}
    measured: str = ""  # date and software versions when measured; "" for tables from public sources
    name: str = field(default="", compare=False)

    def __hash__(self) -> int:
        return hash((self.device, self.sms, tuple(sorted(self.matmul.items())), tuple(sorted(self.attention.items())),
                     self.memory_fraction, self.cache_bytes, self.cache_speedup,
                     self.memory_bytes_half))

    def matmul_efficiency(self, m: float, n: float, k: float, batch: float, dtype: str) -> float:
        curve = self.matmul.get(dtype) or self.matmul.get("bf16") or next(iter(self.matmul.values()))
        return curve.efficiency(m, n, k, batch, self.sms, self.cache_bytes)

    def attention_efficiency(self, seq: float, head_dim: float, backward: bool, causal: bool,
                             kernel: str = "") -> Optional[float]:
        """None when the device has no flash-style kernel (then attention is priced as its matmuls)."""
        curve = self.attention.get(kernel) if kernel else None
        if curve is None and self.attention:
            curve = next(iter(self.attention.values()))  # the table lists the best kernel first
        return curve.efficiency(seq, head_dim, backward, causal) if curve is not None else None

    def memory_efficiency(self, nbytes: float) -> float:
        eff = self.memory_fraction * nbytes / (nbytes + self.memory_bytes_half)
        if self.cache_speedup != 1.0 and self.cache_bytes > 0:
            eff *= cached(self.cache_speedup, nbytes, self.cache_bytes)
        return eff

    def point_efficiency(self, p: Mapping[str, Any]) -> float:
        """What the curves give at one reference point (for checking a table against its points)."""
        if p["kind"] == "matmul":
            return self.matmul_efficiency(p["m"], p["n"], p["k"], p.get("batch", 1), p.get("dtype", "bf16"))
        if p["kind"] == "attention":
            return self.attention_efficiency(p["seq"], p["head_dim"], p.get("direction") == "backward",
                                             bool(p.get("causal", False)), p.get("kernel", "")) or 0.0
        if p["kind"] == "memory":
            return self.memory_efficiency(p["bytes"])
        raise ValueError(f"unknown kernel-table point kind {p['kind']!r} (matmul, attention or memory)")

    # -- files ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out: dict[str, Any] = {"device": self.device, "sms": self.sms,
                               "matmul": {k: vars(v).copy() for k, v in self.matmul.items()},
                               "memory": {"peak_fraction": self.memory_fraction, "bytes_half": self.memory_bytes_half,
                                          "cache_bytes": self.cache_bytes, "cache_speedup": self.cache_speedup}}
        if self.attention:
            out["attention"] = {k: vars(v).copy() for k, v in self.attention.items()}
        if self.measured:
            out["measured"] = self.measured
        out["sources"] = list(self.sources)
        out["points"] = [dict(p) for p in self.points]
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], name: str = "") -> "KernelTable":
        att = d.get("attention")
        mem = d.get("memory", {})
        return cls(device=str(d["device"]), sms=int(d["sms"]),
                   matmul={str(k): MatmulCurve(**{f: v[f] for f in ("peak_fraction", "k_half", "tile_m", "tile_n",
                                                                     "mn_half", "cache_speedup") if f in v})
                           for k, v in d["matmul"].items()},
                   attention={str(k): AttentionCurve(**{f: v[f] for f in ("forward", "backward", "s_half", "d_half",
                                                                         "causal_fraction") if f in v})
                              for k, v in (att or {}).items()},
                   memory_fraction=float(mem.get("peak_fraction", 0.8)),
                   memory_bytes_half=float(mem.get("bytes_half", 1.0e6)),
                   cache_bytes=float(mem.get("cache_bytes", 0.0)), cache_speedup=float(mem.get("cache_speedup", 1.0)),
                   sources=tuple(d.get("sources", ())), points=tuple(dict(p) for p in d.get("points", ())),
                   measured=str(d.get("measured", "")), name=name)


@functools.lru_cache(maxsize=None)
def kernel_table(name: str) -> KernelTable:
    """A shipped table by name ("a100", "h100", "h200", "v100") or a JSON file's path."""
    path = name if name.endswith(".json") else os.path.join(TABLE_DIR, f"{name}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError:
        shipped = sorted(p[:-5] for p in os.listdir(TABLE_DIR) if p.endswith(".json"))
        raise ValueError(f"no kernel table {name!r}: use one of {shipped} or the path of a JSON table "
                         "(benchmarks/measure_tables.py writes one)") from None
    return KernelTable.from_json(data, name=name)
