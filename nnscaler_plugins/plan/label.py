"""A plan in words: "tp 4 x pp 2 x dp 8, 1F1B, 4 micro-batches, ZeRO-2, no recompute".

The same words name a plan in `Plan.explain()`, the search's tables, the command line and every
picture, so a plan found by the search and one written by hand are told apart by what they do.
"""
from __future__ import annotations

from typing import Any

SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B", "zero-bubble": "zero-bubble",
             "interlaced": "interlaced"}


def copies_every_op(plan: Any) -> bool:
    """Whether every op of the plan runs whole on every device of its unit (more than one): the
    unit then computes what one of its devices would, the others the same numbers again."""
    ops = getattr(plan, "ops", None) or {}
    return plan.unit_size > 1 and plan.pipeline is None and bool(ops) and all(
        not p.splits and p.replicate == plan.unit_size for p in ops.values())


def plan_label(plan: Any) -> str:
    """A plan in words: its degrees, schedule, micro-batches, ZeRO stage, recompute and precision.

    Read from the plan's mesh and knobs (the degrees and settings it runs with), so a searched plan
    and a strategy's get the same kind of name. The dense layers' degrees come first, data
    parallelism counting every replica and any batch split inside one; then how experts are split."""
    mesh, knobs, pipe = plan.mesh, plan.knobs, plan.pipeline
    dense = mesh.dense_degrees()
    degrees = []
    if copies_every_op(plan):  # a unit that computes like one device: said, not hidden behind its mesh
        degrees.append(f"every op copied on each of the {plan.unit_size} devices of a replica")
        dense = {"tp": 1, "cp": 1, "pp": 1, "dp": plan.dp}
    elif "unit" in mesh.names and mesh["unit"] > 1:
        degrees.append(f"{mesh['unit']} devices per replica")
        dense["tp"] = 1
    for name in ("tp", "cp", "pp", "dp"):
        if dense[name] > 1:
            degrees.append(f"{name} {dense[name]}" + (f" ({knobs.cp_comm})" if name == "cp" else ""))
    words = [" x ".join(degrees) or "1 device"]
    experts = mesh.expert_degrees()
    ep, etp = experts["ep"], experts["etp"]
    if ep > 1 or etp > 1:
        words.append(f"experts split {ep} ways (ep {ep})" + (f", each expert's width {etp} ways (etp {etp})"
                                                            if etp > 1 else ""))
    if pipe is not None:
        sched = SCHEDULES.get(pipe.schedule, str(pipe.schedule))
        chunks = pipe.num_stages // max(1, pipe.num_ranks)
        words.append(sched + (f" ({chunks} chunks per rank)" if chunks > 1 else ""))
    if plan.num_micro_batches > 1:
        words.append(f"{plan.num_micro_batches} micro-batches")
    words.append(f"ZeRO-{plan.zero}" if plan.zero else "no ZeRO")
    groups = len({p.recompute for p in plan.ops.values() if p.recompute is not None})
    if knobs.recompute in ("full", "selective"):
        words.append(f"{knobs.recompute} recompute")
    elif groups:
        words.append(f"recompute of {groups} group{'s' if groups > 1 else ''}")
    else:
        words.append("no recompute")
    if knobs.sequence_parallel:
        words.append("sequence-parallel")
    if plan.precision != "fp32":
        words.append(str(plan.precision))
    if knobs.compile:
        words.append("compiled")
    if knobs.executor == "eager":
        words.append("eager")
    return ", ".join(words)
