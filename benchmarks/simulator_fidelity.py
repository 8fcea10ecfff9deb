"""Does the simulator reproduce published training runs, 2021 and today's?

Every published point (`points_fit.py`, `points_report.py`, each row with its source there: C1-C3
Megatron-LM and Alpa, 2021; LF-* MosaicML llm-foundry FSDP runs on A100 and H100; TT-* torchtitan on
A100 and H100, FSDP and FSDP x tensor parallelism, plain and async; MLM-H100* Megatron-Core GPT runs on
H100 from 1.7B to 462B: tensor-parallel groups of a node and multi-node pipelines) is written as the
published configuration with the `megatron` strategy's options, simulated on the matching cluster
preset (with the run's own hardware and software facts from the source: power-capped H100s, compiled
or eager, which attention kernel, plain or async TP) and compared with the published step time and
memory.

One constant per software stack is fitted: `Efficiency.sustained`, the fraction of the kernel tables'
speed a whole step of that software sustains, shared by every device, on the rows of `points_fit.py`
only (`--fit`); the rows of `points_report.py` are never fitted. Targets on the report set: step time
within 10 % mean absolute error with no point over 20 %; memory within 10 % on today's stacks.

    python benchmarks/simulator_fidelity.py              # evaluate at the preset's constant, append to RESULTS.md
    python benchmarks/simulator_fidelity.py --fit        # re-fit `sustained` first (a grid), then evaluate
    python benchmarks/simulator_fidelity.py --before     # also the model before the kernel tables and overlap
    python benchmarks/simulator_fidelity.py --only LF-H100 --no-record
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import calibration as C  # noqa: E402
import points_fit  # noqa: E402
from common import record  # noqa: E402

from nnscaler_plugins.search import cluster, simulate  # noqa: E402
from nnscaler_plugins.search.cluster import STACK_2021, STACK_CURRENT  # noqa: E402
from nnscaler_plugins.search.costmodel import CostModel  # noqa: E402
from nnscaler_plugins.search.efficiency import GPU_EFFICIENCY  # noqa: E402

GiB = C.GiB
GRID = tuple(round(0.70 + 0.02 * i, 2) for i in range(16))  # 0.70 .. 1.00


def stack_of(case):
    return STACK_2021 if case.era == "2021" else STACK_CURRENT


def spec_for(case, sustained=None, before: bool = False):
    """The case's cluster: the preset, the run's hardware facts, the run's software stack (its era's
    stack with the facts its source gives)."""
    spec = cluster(case.cluster, nodes=C.nodes_for(case))
    hw = dict(case.hardware)
    if "peak_flops" in hw:
        hw["peak_flops"] = dict(spec.peak_flops, **hw["peak_flops"])
    spec = replace(spec, **hw)
    if before:  # the model before kernel tables and overlap switches: two constants, no tp overlap
        return replace(spec, kernels=None, efficiency=replace(GPU_EFFICIENCY, tp_comm_overlap=False))
    base = stack_of(case)
    return replace(spec, efficiency=replace(base, sustained=sustained or base.sustained, **case.stack))


def evaluate(case, plan, g, sustained=None, before: bool = False):
    spec = spec_for(case, sustained, before)
    return simulate(plan, spec, g, cost_model=CostModel(g, spec))


def measured(case, est) -> list[tuple[str, float, float]]:
    """(quantity, published, simulated) pairs for one case."""
    out = []
    if case.time_s is not None:
        out.append(("time s", case.time_s, est.step_time_s))
    mem = est.memory
    if "states" in case.memory:
        # Korthikanti et al.'s Figure 1 gives the model's states divided evenly over the GPUs (the total
        # parameter count / (t p) x 18 bytes for every model), not the first stage's, which also holds
        # the embedding: the mean over the devices is that quantity.
        per_device = est.details.get("states_per_device") or [mem["params"] + mem["grads"] + mem["optimizer"]]
        out.append(("params+grads+optimizer GiB (mean device)", case.memory["states"],
                    statistics.mean(per_device) / GiB))
    if "activations" in case.memory:
        out.append(("activations GiB", case.memory["activations"], mem["activations"] / GiB))
    if "peak" in case.memory:
        out.append(("peak GiB", case.memory["peak"], peak_of(case, est) / GiB))
    return out


def peak_of(case, est) -> float:
    """The simulated peak to compare with the published one: the largest over the devices, or, for a run
    that logged its last rank's (`Case.peak_rank` "last"), the largest on the last pipeline stage's
    devices. That stage holds the last global rank in Megatron's rank order (tensor-parallel ranks
    innermost, pipeline stages outermost) as in this simulator's unit."""
    if case.peak_rank == "last":
        last = est.details.get("stage_devices", [[]])[-1]
        if last:
            return max(est.peak_memory_bytes[d] for d in last)
    return est.max_memory_bytes


def planned(case):
    t = time.time()
    g = C.graph(case.model, case.micro_batch)
    plan = C.published_plan(case, g)
    print(f"  {case.source} {case.name}: captured and planned in {time.time() - t:.1f} s", flush=True)
    return plan, g


def fit(todo) -> dict:
    """Grid search of each stack's `sustained`, minimising the time MAPE of its fit cases (nothing else is
    fitted); {"2021": value, "current": value}."""
    out = {}
    for stack in ("2021", "current"):
        # the fit set's rows only (points_fit.py): a reported point is never fitted
        rows = [c for c in points_fit.cases() if c.time_s is not None and (c.era == "2021") == (stack == "2021")
                and any(t.source == c.source and t.name == c.name for t in todo)]
        if not rows:
            continue
        errs = {s: [] for s in GRID}
        for case in rows:
            plan, g = planned(case)
            for s in GRID:
                errs[s].append(abs(evaluate(case, plan, g, s).step_time_s / case.time_s - 1))
        table = {s: statistics.mean(e) for s, e in errs.items()}
        for s, m in table.items():
            print(f"  {stack} stack, sustained {s:.2f}: fit-set time MAPE {100 * m:.1f} % over {len(rows)} points",
                  flush=True)
        out[stack] = min(table, key=table.get)
    return out


def describe_plan(case) -> str:
    o = case.options
    v = o.get("virtual_stages", 1)
    return (f"tp{o.get('tp', 1)} pp{o.get('pp', 1)} dp{case.dp} b{case.micro_batch} m{case.micro_batches} "
            f"{o.get('schedule', '')}{' v' + str(v) if v > 1 else ''} rc={o.get('recompute')}"
            f"{' sp' if o.get('sequence_parallel') else ''}{' zero' + str(o['zero']) if 'zero' in o else ''}"
            f"{' compiled' if o.get('compile') else ''}{' fp8' if o.get('precision') == 'fp8' else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--before", action="store_true", help="also price every case with the model before this change")
    ap.add_argument("--only", default="", help="comma-separated sources (C1, C2 full, LF-H100, TT-A100, ...)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    todo = C.cases()
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        todo = [c for c in todo if c.source in keep]
    fitted = {"2021": STACK_2021.sustained, "current": STACK_CURRENT.sustained}
    if args.fit:
        fitted.update(fit(todo))
        print(f"fitted sustained: {fitted} (cluster.py has 2021 {STACK_2021.sustained}, current "
              f"{STACK_CURRENT.sustained})", flush=True)
    rows, errs, before_errs = [], [], []
    for case in todo:
        plan, g = planned(case)
        est = evaluate(case, plan, g, fitted["2021" if case.era == "2021" else "current"])
        old = evaluate(case, plan, g, before=True) if args.before else None
        old_pairs = dict((w, s) for w, _, s in measured(case, old)) if old is not None else {}
        for what, pub, sim in measured(case, est):
            err = sim / pub - 1
            reserved = case.source.startswith("TT-") and what.startswith("peak")
            errs.append((case, what, err, reserved))
            row = [case.source, case.name, case.era, "fit" if case.fit else "report", describe_plan(case), what,
                   f"{pub:.3f}", f"{sim:.3f}", f"{100 * err:+.1f} %"]
            if args.before:
                b = old_pairs.get(what)
                row.append(f"{100 * (b / pub - 1):+.1f} %" if b is not None else "")
                if b is not None:
                    before_errs.append((case, what, b / pub - 1))
            rows.append(tuple(row))
            print(" | ".join(rows[-1]), flush=True)
        del plan, g
        gc.collect()

    def mape(sel) -> str:
        e = [abs(x) for x in sel]
        return f"{100 * statistics.mean(e):.1f} % ({len(e)})" if e else "-"

    def worst(sel) -> str:
        e = [abs(x) for x in sel]
        return f"{100 * max(e):.1f} %" if e else "-"

    times = [(c, e) for c, w, e, _ in errs if w.startswith("time")]
    summary = []
    for label, pick in (("fit set", lambda c: c.fit), ("report set, 2021 (C1-C3)", lambda c: not c.fit and c.era == "2021"),
                        ("report set, A100 current", lambda c: not c.fit and c.era == "A100 current"),
                        ("report set, H100 current", lambda c: not c.fit and c.era == "H100 current"),
                        ("report set, H100 tensor-parallel (tp >= 4)",
                         lambda c: not c.fit and c.era == "H100 current" and c.options.get("tp", 1) >= 4),
                        ("report set, pipelines", lambda c: not c.fit and c.options.get("pp", 1) > 1),
                        ("2021 set, all", lambda c: c.era == "2021"),
                        ("report set, all", lambda c: not c.fit)):
        sel = [e for c, e in times if pick(c)]
        line = f"time MAPE {label}: {mape(sel)}, worst {worst(sel)}"
        if before_errs:
            line += f"; before: {mape([e for c, w, e in before_errs if w.startswith('time') and pick(c)])}"
        summary.append(line)
    mem = [(c, e) for c, w, e, _ in errs if not w.startswith("time")]
    today = [e for c, e in mem if c.era != "2021"]
    fp8 = [e for c, e in mem if c.options.get("precision") == "fp8"]
    mcore = [e for c, e in mem if c.source.startswith("MB-")]
    summary.append(f"memory MAPE: {mape([e for _, e in mem])}; of the 2021 papers' points: "
                   f"{mape([e for c, e in mem if c.era == '2021'])}; of today's stacks (torchtitan's reserved peaks, "
                   f"Megatron-Core's): {mape(today)}, worst {worst(today)}; fp8: {mape(fp8)}, worst {worst(fp8)}; "
                   f"Megatron-Core: {mape(mcore)}, worst {worst(mcore)}")
    summary.append(f"sustained: 2021 stack {fitted['2021']}, current stack {fitted['current']}; "
                   f"{time.time() - t0:.0f} s")
    print("\n" + "\n".join(summary))
    if not args.no_record:
        header = ["source", "case", "era", "use", "plan", "quantity", "published", "simulated", "error"]
        if args.before:
            header.append("error before")
        notes = ("; ".join(summary) + ". Model: per-device kernel tables (nnscaler_plugins/search/tables/*.json, "
                 "public figures, no GPU measured them), overlap switches (search/overlap.py) and software facts as "
                 "each preset's stack or the run's source says, one fitted constant per software stack (`sustained`, "
                 "shared by all devices, fitted on benchmarks/points_fit.py only: rows marked 'fit'; every other row "
                 "is benchmarks/points_report.py, never fitted; sources beside each row there). Unpublished knobs: "
                 "Megatron-Core micro-batch sizes (the largest of 4, 2, 1 that fits without a pipeline, 1 with one) "
                 "and interleaving (the smallest of 2-5 chunks dividing a rank's layers), see calibration.py. Memory: "
                 "torchtitan logs the caching allocator's reserved peak, the simulator prices the bytes in use "
                 "(reserved is above it by the allocator's fragmentation, larger in eager mode than compiled); "
                 "FSDP2 keeps fp32 shards as its master weights (16 bytes per parameter), priced here as a bf16 "
                 "copy plus fp32 master (18). 'error before': the model before the kernel tables and overlap "
                 "switches (two global constants, matmul 0.75 and memory 0.6 of peak, tensor-parallel collectives "
                 "never overlapped).")
        record("simulator_fidelity.py: published training runs (2021 and current stacks) vs the simulator", rows,
               tuple(header), notes, keep_previous=True)


if __name__ == "__main__":
    main()
