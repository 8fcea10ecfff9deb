"""A plan in words: "tp 4 x pp 2 x dp 8, 1F1B, 4 micro-batches, ZeRO-2, no recompute".

The same words name a plan in `Plan.explain()`, the search's tables, the command line and every
picture, so a plan found by the search and one written by hand are told apart by what they do.
"""
from __future__ import annotations

from typing import Any

SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B", "zero-bubble": "zero-bubble",
             "interlaced": "interlaced"}


def plan_label(plan: Any) -> str:
    """A plan in words: its degrees, schedule, micro-batches, ZeRO stage, recompute and precision.

    Read from the fields the runtime runs (and the search's options for what fields do not say),
    never from the search's internal description, so any plan gets the same kind of name."""
    opts = getattr(plan, "options", {}) or {}
    pipe = getattr(plan, "pipeline", None)
    unit = int(getattr(plan, "unit_size", 1) or 1)
    pp = pipe.num_ranks if pipe is not None and hasattr(pipe, "num_ranks") else int(opts.get("pp", 1) or 1)
    group = max(1, unit // max(1, pp))
    cp_asked = int(opts.get("cp", 1) or 1)  # the search's plans record their cp and ep
    expert_plan = getattr(plan, "strategy", None) == "ep"
    if opts.get("tp"):
        tp = int(opts["tp"])
    elif cp_asked > 1:  # a cp plan without tp= splits the sequence over the whole group
        tp = group // cp_asked
    elif expert_plan:  # the ep strategy's dense part is batch-split inside the unit
        tp = 1
    else:
        tp = group
    tp = max(1, min(tp, group))
    cp = max(1, min(cp_asked, group // tp))
    dp = int(getattr(plan, "dp", 1) or 1) * max(1, group // (tp * cp))  # batch splits inside a unit are data parallel too
    degrees = [f"{name} {n}" for name, n in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)) if n > 1]
    if cp > 1 and opts.get("cp_comm"):
        degrees[[d.split()[0] for d in degrees].index("cp")] += f" ({opts['cp_comm']})"
    words = [" x ".join(degrees) or "1 device"]
    etp = int(opts.get("etp", 1) or 1)
    ep = int(opts.get("ep", 0) or 0) or (group // etp if expert_plan else 1)
    if ep > 1 or etp > 1:
        words.append(f"experts split {ep} ways (ep {ep})" + (f", each expert's width {etp} ways (etp {etp})"
                                                            if etp > 1 else ""))
    if pipe is not None:
        sched = SCHEDULES.get(pipe.schedule, str(pipe.schedule))
        chunks = pipe.num_stages // max(1, pp)
        words.append(sched + (f" ({chunks} chunks per rank)" if chunks > 1 else ""))
    m = int(getattr(plan, "num_micro_batches", getattr(plan, "micro_batches", 1)) or 1)
    if m > 1:
        words.append(f"{m} micro-batches")
    zero = int(getattr(plan, "zero", 0) or 0)
    words.append(f"ZeRO-{zero}" if zero else "no ZeRO")
    recompute = opts.get("recompute")
    if recompute in (None, "none"):
        ops = getattr(plan, "ops", {}) or {}
        recompute = "some" if any(getattr(p, "recompute", None) is not None for p in ops.values()) else None
    words.append("no recompute" if recompute in (None, "none") else f"{recompute} recompute")
    if opts.get("sequence_parallel"):
        words.append("sequence-parallel")
    precision = getattr(plan, "precision", "fp32")
    if precision and precision != "fp32":
        words.append(str(precision))
    return ", ".join(words)
