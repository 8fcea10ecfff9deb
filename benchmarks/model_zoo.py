"""The model zoo under every plan: which architectures capture, and which train at world 2 exactly
like one process (SGD, fp32, relative 1e-5) under dp, tp, 1f1b and zero3; for tp, the fraction of
the model's matmul FLOPs the plan splits.

    python benchmarks/model_zoo.py [name ...]

The zoo is tests/zoo_models.py (small configurations of Hugging Face architectures, random
weights, no downloads); the reference is the same model in one process on the global batch
(tests/sgd_check.py). Writes the table into benchmarks/RESULTS.md under "benchmarks/model_zoo.py".
"""
from __future__ import annotations

import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import common  # noqa: E402

PLANS = [("dp", {}, 2), ("tp", {}, 1), ("1f1b", {"pp": 2, "micro_batches": 2}, 1), ("zero3", {}, 2)]


def _eval_build(name: str):
    import zoo_models

    def build():
        model, batch = zoo_models.build(name)
        model.eval()
        return model, batch
    return build


def _short(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:90]}".replace("|", "/")


def _train_all(rank: int, world: int, names: list[str]) -> dict:
    from sgd_check import sgd_equivalence

    out = {}
    warnings.simplefilter("ignore")
    for name in names:
        for plan, options, dp in PLANS:
            started = time.perf_counter()
            try:
                problems = sgd_equivalence(rank, world, _eval_build(name), plan, dict(options), dp,
                                           what=f"{name} {plan}", cache_dir=f"/tmp/nns_zoo_bench_{rank}")
                out[(name, plan)] = "exact" if not problems else f"differs: {problems[0][:80]}"
            except Exception as e:  # noqa: BLE001 - reported in the table
                out[(name, plan)] = f"fails: {_short(e)}"
            out[(name, plan, "s")] = time.perf_counter() - started
    return out


def _capture_and_tp(name: str) -> tuple[str, str]:
    import nnscaler_plugins as nns
    from nnscaler_plugins.capture.tracing import capture
    from nnscaler_plugins.passes.tensor_parallel import split_matmul_flops

    model, batch = _eval_build(name)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph = capture(model, batch)
        except Exception as e:  # noqa: BLE001
            return f"no ({_short(e)})", "-"
        try:
            plan = nns.plan(graph, strategy="tp", world_size=2)
        except Exception as e:  # noqa: BLE001
            return "yes", f"plan fails: {_short(e)}"
    done, total = split_matmul_flops(graph, plan)
    return "yes", f"{done / total:.1%}" if total else "no matmuls"


TITLE = "benchmarks/model_zoo.py: architectures under every plan"


def _previous_rows() -> list[tuple[str, ...]]:
    """The table rows this script wrote last time, so a run over some architectures updates theirs."""
    rows = []
    for line in common.recorded_section(TITLE):
        cells = tuple(c.strip() for c in line.strip().strip("|").split("|"))
        if line.startswith("| ") and len(cells) == 7 and cells[0] != "architecture":
            rows.append(cells)
    return rows


def _in_zoo_order(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    import zoo_models

    order = {n: i for i, n in enumerate(zoo_models.ZOO)}
    return sorted(rows, key=lambda r: order.get(r[0], len(order)))


def main(names: list[str]) -> None:
    """One model at a time (capture and tp fraction here, the four plans on 2 workers); the table
    in RESULTS.md is rewritten after each, so a run cut short still records what it measured."""
    import zoo_models

    names = names or list(zoo_models.ZOO)
    started = time.perf_counter()
    kept = [r for r in _previous_rows() if r[0] not in names]  # architectures this run does not measure
    rows, exact, runs = [], 0, 0
    for n in names:
        captured, fraction = _capture_and_tp(n)
        trained = common.spawn(_train_all, 2, [n]) if captured == "yes" else {}
        cells = [trained.get((n, p), "-") for p, _, _ in PLANS]
        exact += sum(1 for c in cells if c == "exact")
        runs += sum(1 for c in cells if c != "-")
        tp = f"{cells[1]}, splits {fraction}" if cells[1] != "-" else fraction
        rows.append((n, zoo_models.FAMILY[n], captured, cells[0], tp, cells[2], cells[3]))
        print(" | ".join(rows[-1]), flush=True)
        done = f"{len(rows)} of {len(names)} architectures" if len(rows) < len(names) else f"{len(rows)} architectures"
        notes = (f"This run: {done}, {exact}/{runs} plan runs exact against one process on the global batch (2 gloo "
                 f"processes, 2 SGD steps, fp32, relative 1e-5); tp's fraction is the share of the model's matmul "
                 f"FLOPs (linear, matmuls, convolutions, grouped expert matmuls, attention) its plan splits. "
                 f"{time.perf_counter() - started:.0f} s so far.")
        if kept:
            notes += (f" The other {len(kept)} rows ({', '.join(r[0] for r in kept)}) are from the script's previous "
                      "run; every row's plan runs were exact there unless the row says otherwise.")
        common.record(TITLE, _in_zoo_order(kept + rows),
                      ("architecture", "family", "captured", "dp", "tp (matmul FLOPs split)", "1f1b", "zero3"), notes)


if __name__ == "__main__":
    main(sys.argv[1:])
