"""The search's answer: plans on the Pareto frontier of (step time, peak memory per device).

A `ParetoSet` is a list of `Plan`s, fastest first, none of which is both slower and larger than
another; each carries its simulated estimate (`plan.estimate`, a dict, with `Estimate` objects in
`.estimates`). It iterates like a list; `best` is the fastest plan, `fastest_within(bytes)` the
fastest under a memory budget, `hypervolume(ref)` the area it dominates (used to compare searches).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.search.simulator import Estimate

GiB = 1024 ** 3


def frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated (time, memory) points, fastest first (ties: smaller memory)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    out, best_mem = [], float("inf")
    for i in order:
        if points[i][1] < best_mem:
            out.append(i)
            best_mem = points[i][1]
    return out


def hypervolume(points: Sequence[tuple[float, float]], ref: tuple[float, float]) -> float:
    """Area dominated by `points` (minimising both) and bounded by the reference point."""
    pts = sorted((t, m) for t, m in points if t < ref[0] and m < ref[1])
    area, prev_m = 0.0, ref[1]
    for t, m in pts:
        if m < prev_m:
            area += (ref[0] - t) * (prev_m - m)
            prev_m = m
    return area


@dataclass
class ParetoSet:
    plans: list[Plan]
    estimates: list[Estimate]
    searched: int = 0  # candidates the search priced
    simulated: int = 0  # candidates it simulated in full
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Plan]:
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> Plan:
        return self.plans[i]

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def points(self) -> list[tuple[float, float]]:
        return [(e.step_time_s, e.max_memory_bytes) for e in self.estimates]

    def fastest_within(self, memory_bytes: float) -> Optional[Plan]:
        for p, e in zip(self.plans, self.estimates):
            if e.max_memory_bytes <= memory_bytes:
                return p
        return None

    def hypervolume(self, ref: tuple[float, float]) -> float:
        return hypervolume(self.points(), ref)

    def table(self) -> str:
        """One line per plan, numbered and worded as `render_pareto` draws them."""
        from nnscaler_plugins.plan.label import plan_label
        from nnscaler_plugins.units import fmt_bytes, fmt_seconds

        lines = [f"{'#':>3}  {'step time':>9}  {'peak memory':>11}  plan"]
        for i, (p, e) in enumerate(zip(self.plans, self.estimates)):
            lines.append(f"{'#' + str(i):>3}  {fmt_seconds(e.step_time_s):>9}  {fmt_bytes(e.max_memory_bytes):>11}  "
                         f"{plan_label(p)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ParetoSet of {len(self.plans)} plans>\n{self.table()}"
