"""Does the simulator reproduce the published calibration points (docs/cost-model.md)?

For every row of C1 (Megatron-LM PTD-P), C2 (sequence parallelism and selective recomputation) and
C3 (Alpa), the published configuration is written with the `megatron` strategy's options, simulated
on the matching cluster preset, and compared with the published step time and memory. Targets:
mean absolute percentage error <= 10 % for times, <= 15 % for memory.

    python benchmarks/simulator_fidelity.py          # the table, appended to RESULTS.md
    python benchmarks/simulator_fidelity.py --fit    # re-fit the efficiency constants first

`--fit` searches the matmul and memory efficiencies (the only constants fitted, see
nnscaler_plugins/search/efficiency.py) on a grid, minimising the MAPE of C1 and C2 step times; C3
is never used for fitting.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import calibration as C  # noqa: E402
from common import record  # noqa: E402

from nnscaler_plugins.search import cluster, simulate  # noqa: E402
from nnscaler_plugins.search.costmodel import CostModel  # noqa: E402
from nnscaler_plugins.search.efficiency import GPU_EFFICIENCY  # noqa: E402

GiB = C.GiB


def evaluate(case, plan, g, efficiency=GPU_EFFICIENCY):
    spec = replace(cluster(case.cluster, nodes=C.nodes_for(case)), efficiency=efficiency)
    return simulate(plan, spec, g, cost_model=CostModel(g, spec))


def measured(case, est) -> list[tuple[str, float, float]]:
    """(quantity, published, simulated) pairs for one case."""
    out = []
    if case.time_s is not None:
        out.append(("time s", case.time_s, est.step_time_s))
    mem = est.memory
    if "states" in case.memory:
        out.append(("params+grads+optimizer GiB", case.memory["states"],
                    (mem["params"] + mem["grads"] + mem["optimizer"]) / GiB))
    if "activations" in case.memory:
        out.append(("activations GiB", case.memory["activations"], mem["activations"] / GiB))
    if "peak" in case.memory:
        out.append(("peak GiB", case.memory["peak"], est.max_memory_bytes / GiB))
    return out


def collect(fit: bool = False):
    todo = C.cases()
    plans = []
    for case in todo:
        t = time.time()
        g = C.graph(case.model, case.micro_batch)
        plan = C.published_plan(case, g)
        plans.append((case, plan, g))
        print(f"  {case.source} {case.name}: captured and planned in {time.time() - t:.1f} s", flush=True)
        if fit:
            continue
    return plans


def fit(plans) -> tuple:
    """Grid search of (matmul, memory) efficiency on C1 and C2 times."""
    rows = [(c, p, g) for c, p, g in plans if c.source != "C3" and c.time_s is not None]
    best = None
    for mm in (0.6, 0.65, 0.7, 0.75, 0.8):
        for mem in (0.5, 0.6, 0.7, 0.8):
            eff = replace(GPU_EFFICIENCY, matmul=mm, memory=mem)
            errs = [abs(evaluate(c, p, g, eff).step_time_s / c.time_s - 1) for c, p, g in rows]
            mape = statistics.mean(errs)
            print(f"  matmul {mm:.2f} memory {mem:.2f}: MAPE {100 * mape:.1f} %", flush=True)
            if best is None or mape < best[0]:
                best = (mape, eff)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    plans = collect()
    eff = GPU_EFFICIENCY
    if args.fit:
        mape, eff = fit(plans)
        print(f"best fit: {eff} (C1+C2 time MAPE {100 * mape:.1f} %)")
    rows, time_err, mem_err, mem_sp = [], [], [], []
    for case, plan, g in plans:
        est = evaluate(case, plan, g, eff)
        for what, pub, sim in measured(case, est):
            err = sim / pub - 1
            if what.startswith("time"):
                time_err.append(abs(err))
            else:
                mem_err.append(abs(err))
                mem_sp.append(bool(case.options.get("sequence_parallel")))
            rows.append((case.source, case.name, f"tp{case.options.get('tp', 1)} pp{case.options.get('pp', 1)} "
                         f"dp{case.dp} m{case.micro_batches} {case.options.get('schedule', '')}"
                         f"{' v' + str(case.options.get('virtual_stages')) if case.options.get('virtual_stages', 1) > 1 else ''}"
                         f" rc={case.options.get('recompute')}{' sp' if case.options.get('sequence_parallel') else ''}"
                         f"{' zero' + str(case.options['zero']) if 'zero' in case.options else ''}",
                         what, f"{pub:.3f}", f"{sim:.3f}", f"{100 * err:+.1f} %"))
            print(" | ".join(rows[-1]), flush=True)
    t_mape = 100 * statistics.mean(time_err)
    m_mape = 100 * statistics.mean(mem_err)
    sp_rows = [e for e, sp in zip(mem_err, mem_sp) if sp]
    rest = [e for e, sp in zip(mem_err, mem_sp) if not sp]
    m_mape_no_sp = 100 * statistics.mean(rest) if rest else m_mape
    print(f"\ntime MAPE {t_mape:.1f} % over {len(time_err)} points (target <= 10 %); "
          f"memory MAPE {m_mape:.1f} % over {len(mem_err)} points (target <= 15 %), {m_mape_no_sp:.1f} % without the "
          f"{len(sp_rows)} sequence-parallel points; {time.time() - t0:.0f} s")
    if not args.no_record:
        notes = (f"Time MAPE **{t_mape:.1f} %** over {len(time_err)} points (target <= 10 %), memory MAPE "
                 f"**{m_mape:.1f} %** over {len(mem_err)} points (target <= 15 %). Fitted constants (the only ones): "
                 f"matmul efficiency {eff.matmul}, memory-bandwidth efficiency {eff.memory}; network efficiency "
                 f"{eff.network} and launch cost {eff.op_overhead_s * 1e6:g} us are set, not fitted; C3 is not used "
                 "in the fit. Plans: the `megatron` strategy with the published tp/pp/dp, micro-batch size 1 (C2 22B: "
                 "4), interleaving chunks as listed (C1 does not publish them: the smallest v > 1 dividing the layers "
                 "per pipeline rank), full recomputation for C1 as the paper. Largest errors: C3 time (Alpa on V100 "
                 "reaches less of its peak than Megatron-LM on A100, and the two fitted efficiencies come from the A100 "
                 "rows only) and the C2 selective-recomputation + sequence-parallel activations (about 2.3x the "
                 f"published; memory MAPE without those {len(sp_rows)} points: **{m_mape_no_sp:.1f} %**). Plans are "
                 "priced as placed since sequence parallelism became splits the plan carries (before, a Megatron "
                 "discount was applied to ops the plan ran whole, which matched the paper and not this runtime): "
                 "this runtime's sequence-parallel plan keeps more than Megatron does, most visibly the whole input "
                 "of each column-parallel matmul, gathered from the sequence shards, which autograd saves for the "
                 "weight gradient (Megatron saves the shard and gathers it again in backward). Closing that gap is a "
                 "runtime change, not a simulator one.")
        record("simulator_fidelity.py: published calibration points vs the simulator", rows,
               ("source", "model", "plan", "quantity", "published", "simulated", "error"), notes)


if __name__ == "__main__":
    main()
