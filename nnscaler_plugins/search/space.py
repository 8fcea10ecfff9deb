"""The search space: the inter-op knobs of a candidate plan, and how they are read back from a plan.

A candidate is a `Config` (how the world is cut into pipeline stages, device groups per stage and
data-parallel replicas; micro-batches and schedule; ZeRO stage and recomputation) plus, per op, an
intra-op choice for the stage's device group: an `Axes` tuple that says along which label each axis
of the group's device mesh splits the op (None: the op is copied along that axis). A group of 8
devices seen as one axis of 8 takes choices like (("n", 8),); seen as 2 x 4 it takes choices like
(("batch-label", 2), ("n", 4)), which is data parallelism over 2 inside the group and tensor
parallelism over 4 within each half.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from nnscaler_plugins.capture.graph import Graph
from nnscaler_plugins.plan.mesh import Mesh
from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.search.dims import batch_size

Axes = tuple  # ((label or None, size), ...) outer to inner; the product of sizes is the group size

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Config:
    """The inter-op part of a candidate."""

    group: int  # devices per pipeline stage (the intra-op mesh)
    mesh: tuple[int, ...]  # the group seen as a mesh (outer to inner); prod == group
    pp: int  # pipeline ranks
    dp: int  # data-parallel replicas of the unit (the plan's dp)
    micro_batch_size: int
    micro_batches: int
    schedule: str = "none"  # "none" without a pipeline
    virtual: int = 1  # interleaving chunks per pipeline rank
    zero: int = 0
    recompute: str = "none"
    tp: int = 1  # the largest split of an op that is not along the batch (for constraints)
    sequence_parallel: bool = False  # Megatron's option: the layers' norms and residual adds split along the sequence
    cp: int = 1  # context parallelism: attention (and what carries the sequence) split along it cp ways
    cp_comm: str = "ring"  # how attention pieces meet their keys under cp (ring, allgather, ulysses)
    ep: int = 1  # expert parallelism: experts of a mixture-of-experts layer split ep ways with their tokens
    batch: int = 0  # the batch split inside the group (0: whatever of the group tp and cp leave)

    @property
    def unit_size(self) -> int:
        return self.group * self.pp

    @property
    def world_size(self) -> int:
        return self.unit_size * self.dp

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        pipe = f" pp={self.pp} {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "") \
            if self.pp > 1 else ""
        return (f"group {self.group} (mesh {mesh}, tp {self.tp}){pipe} dp={self.dp} micro-batch "
                f"{self.micro_batch_size} x {self.micro_batches} zero={self.zero} recompute={self.recompute}"
                + (" sequence-parallel" if self.sequence_parallel else "")
                + (f" cp={self.cp} {self.cp_comm}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else ""))

    def to_json(self) -> dict:
        return {"group": self.group, "mesh": list(self.mesh), "pp": self.pp, "dp": self.dp,
                "micro_batch_size": self.micro_batch_size, "micro_batches": self.micro_batches,
                "schedule": self.schedule, "virtual": self.virtual, "zero": self.zero, "recompute": self.recompute,
                "tp": self.tp, "sequence_parallel": self.sequence_parallel, "cp": self.cp, "cp_comm": self.cp_comm,
                "ep": self.ep}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(group: int) -> list[tuple[int, ...]]:
    """One axis, or two axes a x b (outer x inner), for a device group."""
    out = [(group,)]
    for a in divisors(group):
        if 1 < a < group:
            out.append((a, group // a))
    return out


def axes_tp(axes: Axes, batch_label: Optional[str]) -> int:
    """Pieces along labels other than the batch label."""
    return math.prod(n for l, n in axes if l is not None and l != batch_label)


def mesh_of_config(cfg: Config) -> Mesh:
    """The mesh of a candidate's plan: its replicas, pipeline ranks, and in each stage's group the
    batch split, context and tensor parallelism (experts split over those devices are folded in).
    A group those splits do not account for (its ops copied over some of its devices: a batch
    split smaller than the group tp and cp leave) is a bare unit of devices, not a batch split."""
    inner = cfg.tp * cfg.cp
    batch = cfg.group // inner if not cfg.group % inner else 0
    if not batch or 0 < cfg.batch < batch:
        names, sizes = ("dp", "pp", "unit"), (cfg.dp, cfg.pp, cfg.group)
    else:
        names, sizes = ("dp", "pp", "batch", "cp", "tp"), (cfg.dp, cfg.pp, batch, cfg.cp, cfg.tp)
    folded = (("ep", cfg.ep),) if cfg.ep > 1 else ()
    return Mesh(names, sizes, 1, folded)


def config_of(plan: Plan, graph: Graph) -> Config:
    """A plan's inter-op knobs as the search's configuration (for constraint checks on any plan),
    read from its mesh and knobs."""
    mesh, knobs, pl = plan.mesh, plan.knobs, plan.pipeline
    dense = mesh.dense_degrees()
    pp = pl.num_ranks if pl is not None else 1
    virtual = pl.num_stages // pl.num_ranks if pl is not None else 1
    group = plan.unit_size // pp if pp else plan.unit_size
    tp, cp = dense["tp"], dense["cp"]
    batch_split = max(1, dense["dp"] // plan.dp)
    b = batch_size(graph) or 1
    return Config(group=group, mesh=(group,), pp=pp, dp=plan.dp, micro_batch_size=max(1, b // batch_split),
                  micro_batches=plan.num_micro_batches, schedule=pl.schedule if pl is not None else "none",
                  virtual=virtual, zero=int(plan.zero), recompute=knobs.recompute, tp=tp, sequence_parallel=knobs.sequence_parallel, cp=cp, cp_comm=knobs.cp_comm,
                  ep=mesh.expert_degrees()["ep"])


def with_(cfg: Config, **changes: Any) -> Config:
    return replace(cfg, **changes)
