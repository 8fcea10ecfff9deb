"""A pipeline step as a picture: one row per pipeline rank (or device), one box per task, the gaps
between boxes being the pipeline's bubbles. Forward tasks blue, backward green, weight-gradient
purple, forwards without gradients grey. With the simulator's estimate, each rank's exposed gradient
synchronization and its optimizer step follow its last task, so the axis ends at the step time the
title states. Steps of many micro-batches are drawn with the middle folded: the first and last
micro-batches as boxes, the fold as each rank's utilization.

Part of the plan's layer because a timeline is op-order made visible (`Plan.render_timeline`);
`nnscaler_plugins.render` re-exports it beside the other pictures.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from nnscaler_plugins.plan.timeline import fold_window
from nnscaler_plugins.svg import Canvas, esc, legend, nice_ticks, text_width, write_picture
from nnscaler_plugins.units import fmt_seconds, number

COLORS = {"F": "#4C78A8", "B": "#54A24B", "W": "#B279A2", "F~": "#BAB0AC", "sync": "#F58518", "opt": "#9D755D"}


def render_timeline(timeline: Any, path: Optional[str] = None, title: str = "", unit: str = "s",
                    row_label: str = "rank", estimate: Any = None, grad_sync_s: Any = 0.0,
                    optimizer_s: float = 0.0, fold: Optional[bool] = None, keep: int = 3) -> str:
    """Draw a `timeline.Timeline` (from `timeline.replay`, `Plan.timeline` or `nns.simulate(...,
    keep_timeline=True).timeline`), one row per rank (`row_label` "device" for per-device rows).

    `estimate` (the simulator's) adds each rank's exposed gradient synchronization and its optimizer
    step after its last task (or give `grad_sync_s`, per rank or one number, and `optimizer_s`).
    `fold`: draw the first and last `keep` micro-batches and fold the middle (default: when the
    step has more than 16 micro-batches)."""
    events = timeline.events
    rows = len(events)
    if estimate is not None:
        details = getattr(estimate, "details", {}) or {}
        grad_sync_s = details.get("exposed_grad_sync_s", grad_sync_s)
        optimizer_s = float(details.get("optimizer_s", optimizer_s) or 0.0)
    sync = list(grad_sync_s) if isinstance(grad_sync_s, (list, tuple)) else [float(grad_sync_s or 0.0)] * rows
    sync = (sync + [0.0] * rows)[:rows]
    ends = [max((e.end for e in evs), default=0.0) for evs in events]
    pipe_span = timeline.makespan or 1.0
    span = max((ends[r] + sync[r] + optimizer_s for r in range(rows)), default=pipe_span) or 1.0
    fmt = fmt_seconds if unit == "s" else (lambda v: f"{number(v)} {unit}")
    window = None
    if fold or (fold is None and timeline.shape.micro_batches > 16):
        window = fold_window(timeline, keep)

    labels = [f"{row_label} {r}" for r in range(rows)]
    left = 14 + max((text_width(s) for s in labels), default=40)
    width = 1100
    plot_w = width - left - 20
    c = Canvas()
    y = c.lines(left, 22, title or "pipeline timeline", plot_w, size=14)
    bubble = timeline.bubble_fraction() if hasattr(timeline, "bubble_fraction") else 0.0
    parts = [f"step {fmt(span)}"]
    if optimizer_s or any(sync):
        parts[0] += f" = pipeline {fmt(pipe_span)}"
        if any(sync):
            parts[0] += f" + exposed gradient sync up to {fmt(max(sync))}"
        if optimizer_s:
            parts[0] += f" + optimizer {fmt(optimizer_s)}"
    parts.append(f"pipeline bubble {100 * bubble:.1f} %")
    parts.append(f"{timeline.shape.micro_batches} micro-batches")
    y = c.lines(left, y + 2, "; ".join(parts), plot_w, fill="#333")
    top = y + 6
    row_h, gap = 26, 6

    # x: one linear scale, or three pieces (head, fold, tail) when the middle is folded
    fold_w = 110.0
    if window is not None:
        head, tail = window
        rest = span - tail
        px = (plot_w - fold_w) / (head + rest)

        def sx(t: float) -> float:
            if t <= head:
                return left + t * px
            if t >= tail:
                return left + head * px + fold_w + (t - tail) * px
            return left + head * px + fold_w * (t - head) / (tail - head)
    else:
        def sx(t: float) -> float:
            return left + t / span * plot_w

    def box(x0: float, x1: float, y0: float, color: str, tip: str, label: str = "") -> None:
        w = max(x1 - x0, 0.6)
        c.raw(f"<rect x='{x0:.2f}' y='{y0:.1f}' width='{w:.2f}' height='{row_h}' fill='{color}' stroke='white' "
              f"stroke-width='0.5'><title>{esc(tip)}</title></rect>")
        if label and w > text_width(label, 10) + 4:
            c.text(x0 + w / 2, y0 + row_h * 0.65, label, 10, "middle", "white")

    for r in range(rows):
        c.raw(f"<rect x='{left}' y='{top + r * (row_h + gap):.1f}' width='{plot_w:.1f}' height='{row_h}' "
              "fill='#f3f3f3'/>")
    grid_at = len(c.body)  # grid lines go over the bands and under the boxes
    for r, evs in enumerate(events):
        y0 = top + r * (row_h + gap)
        c.text(left - 8, y0 + row_h * 0.65, labels[r], anchor="end")
        for e in evs:
            if window is not None and e.start >= window[0] and e.end <= window[1]:
                continue
            t = e.task
            tip = f"{t}: stage {t.stage}, micro-batch {t.micro_batch}, {fmt(e.start)} to {fmt(e.end)}"
            box(sx(e.start), sx(e.end), y0, COLORS[t.kind if t.grad else "F~"], tip, str(t))
        x = ends[r]
        if sync[r] > 0:
            box(sx(x), sx(x + sync[r]), y0, COLORS["sync"], f"gradient sync (exposed): {fmt(sync[r])}", "sync")
            x += sync[r]
        if optimizer_s > 0:
            box(sx(x), sx(x + optimizer_s), y0, COLORS["opt"], f"optimizer step: {fmt(optimizer_s)}", "opt")
        if window is not None:
            busy = timeline.utilization(*window)[r]
            fx = sx(window[0])
            c.raw(f"<rect x='{fx:.1f}' y='{y0:.1f}' width='{fold_w:.1f}' height='{row_h}' fill='url(#folded)' "
                  f"stroke='#999'><title>{esc(f'folded: {fmt(window[1] - window[0])}, busy {100 * busy:.1f} %')}"
                  "</title></rect>")
            c.text(fx + fold_w / 2, y0 + row_h * 0.65, f"busy {100 * busy:.0f} %", 10, "middle", "#222")

    axis_y = top + rows * (row_h + gap) + 12
    if window is not None:
        c.raw("<defs><pattern id='folded' width='6' height='6' patternUnits='userSpaceOnUse' "
              "patternTransform='rotate(45)'><rect width='6' height='6' fill='#eeeeee'/>"
              "<line x1='0' y1='0' x2='0' y2='6' stroke='#cccccc' stroke-width='2'/></pattern></defs>")
        ticks = _piece_ticks(0.0, window[0], sx, 2) + _piece_ticks(window[1], span, sx, 3)
        mid = sx(window[0]) + fold_w / 2
        folded = timeline.shape.micro_batches - 2 * keep
        c.text(mid, axis_y + 4, f"~{folded} micro-batches", 10, "middle", "#555")
        c.text(mid, axis_y + 17, f"folded ({fmt(window[1] - window[0])})", 10, "middle", "#555")
    else:
        ticks = [(t, sx(t)) for t in nice_ticks(span) if t <= span * 1.0001]
    last_right = -1e9
    for t, x in ticks:
        label = fmt(t)
        b = c.box(x, axis_y + 4, label, 11, "middle")
        if b[0] < last_right + 6 or b[0] < 0 or b[2] > width or not c.free(b):
            continue
        c.body.insert(grid_at, f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{top - 4:.1f}' y2='{axis_y - 8:.1f}' "
                      "stroke='#ccc'/>")
        c.text(x, axis_y + 4, label, anchor="middle")
        last_right = b[2]
    items = [("forward", COLORS["F"]), ("backward", COLORS["B"]), ("weight gradient", COLORS["W"]),
             ("no-grad forward", COLORS["F~"])]
    if any(sync):
        items.append(("gradient sync (exposed)", COLORS["sync"]))
    if optimizer_s:
        items.append(("optimizer step", COLORS["opt"]))
    note = "Empty stretches of a row are bubbles (the rank waits)."
    if window is not None:
        note += (f" Hatched: the middle of the step, folded; the first and last {keep} micro-batches are drawn"
                 " and each row shows how busy the rank is in the folded part.")
    y_end = legend(c, left, axis_y + 30, plot_w, items, note)
    return write_picture(c.svg(width, y_end + 4), path, title or "pipeline timeline")


def _piece_ticks(lo: float, hi: float, sx: Any, n: int) -> list[tuple[float, float]]:
    """Round tick values inside [lo, hi] for one piece of a folded axis."""
    if hi <= lo:
        return []
    step = nice_ticks(hi - lo, n)[1]
    first = math.ceil(lo / step - 1e-9) * step
    out = []
    t = first
    while t <= hi * 1.0001:
        out.append((t, sx(t)))
        t += step
    return out
