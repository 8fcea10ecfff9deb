"""Pictures of plans a person opens in a browser: SVG (or HTML around the SVG), no dependencies.

    render_timeline(timeline, "timeline.svg", estimate=est)   # one row per pipeline rank, one box per task
    render_pareto(pareto_set, "pareto.svg", memory_limit=40 * 2**30)   # step time against peak memory
    render_device_map(plan, "devices.html")                   # which device runs which parts of the model

Every function takes a destination path, writes the file (".html" wraps the SVG in a page, any
other name gets plain SVG) and returns the SVG text. Boxes carry <title> tooltips with the exact
numbers, so hovering shows what a box is; what is printed is rounded, with units (ms, MiB), for
reading at a glance.

Text is laid out with an estimate of its width (`text_width`), so nothing is drawn past the frame
and labels that would collide are moved or left to the legend; tests check that on rendered
pictures. Plans are named in words (`plan_label`: "tp 4 x pp 2 x dp 8, 1F1B, ZeRO-2, no
recompute"), the same words and numbers as `ParetoSet.table()`.

Timelines: forward tasks blue, backward green, weight-gradient purple, forwards without gradients
grey; the gaps between boxes are the pipeline's bubbles. With an estimate, each rank's exposed
gradient synchronization and its optimizer step follow its last task, so the axis ends at the step
time the title states. Steps of many micro-batches are drawn with the middle folded: the first and
last micro-batches as boxes, the fold as each rank's utilization.
"""
from __future__ import annotations

import html
import math
import os
import re
from typing import Any, Optional, Sequence

COLORS = {"F": "#4C78A8", "B": "#54A24B", "W": "#B279A2", "F~": "#BAB0AC", "sync": "#F58518", "opt": "#9D755D"}
STAGE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                "#9D755D", "#BAB0AC"]
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B", "zero-bubble": "zero-bubble",
             "interlaced": "interlaced"}
KiB = 1024


# -- words and numbers -----------------------------------------------------------------------------------
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


_UNITS_S = ((1e-6, "µs"), (1e-3, "ms"), (1.0, "s"), (60.0, "min"))
_UNITS_B = ((1, "B"), (KiB, "KiB"), (KiB ** 2, "MiB"), (KiB ** 3, "GiB"), (KiB ** 4, "TiB"))


def _unit_for(x: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The largest unit in which `x` is at least 1 (the smallest for 0)."""
    best = units[0]
    for scale, name in units:
        if abs(x) >= scale:
            best = (scale, name)
    return best


def _num(v: float) -> str:
    """Three significant digits at most, no trailing zeros: 40.4, 9.25, 120, 0.5."""
    if v == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
    text = f"{v:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_seconds(s: float) -> str:
    """A time as people read it: 850 µs, 40.4 ms, 1.2 s, 3.1 min."""
    if s == 0:
        return "0"
    scale, name = _unit_for(s, _UNITS_S)
    return f"{_num(s / scale)} {name}"


def fmt_bytes(b: float) -> str:
    """Bytes as people read them: 512 B, 9.2 MiB, 38.5 GiB."""
    if b == 0:
        return "0"
    scale, name = _unit_for(b, _UNITS_B)
    return f"{_num(b / scale)} {name}"


def nice_ticks(top: float, n: int = 5) -> list[float]:
    """0 and round steps (1, 2, 2.5 or 5 times a power of ten) up to at least `top`."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 2.5, 5, 10) if k * mag >= raw)
    count = math.ceil(top / step - 1e-9)
    return [i * step for i in range(count + 1)]


# -- text that fits ------------------------------------------------------------------------------------------
_NARROW = set("ijlI.,:;'|!()[] ")
_WIDE = set("mwMW@%")


def text_width(text: str, size: float = 11) -> float:
    """Estimated width in pixels of `text` in a sans-serif font of `size` px (DejaVu/Arial-like
    widths, rounded up), used to keep text inside the frame and apart from other text."""
    em = 0.0
    for ch in text:
        if ch in _NARROW:
            em += 0.34
        elif ch in _WIDE:
            em += 0.92
        elif ch.isupper() or ch.isdigit() or ch in "#_~=+<>?&":
            em += 0.68
        else:
            em += 0.6
    return em * size


def _wrap(text: str, size: float, width: float) -> list[str]:
    """Words of `text` in lines no wider than `width`."""
    lines, line = [], ""
    for word in text.split(" "):
        trial = f"{line} {word}" if line else word
        if line and text_width(trial, size) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + ([line] if line else [])


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


class Canvas:
    """SVG elements plus the boxes of the text drawn so far (for placing labels that do not collide)."""

    def __init__(self) -> None:
        self.body: list[str] = []
        self.boxes: list[tuple[float, float, float, float]] = []

    def box(self, x: float, y: float, text: str, size: float, anchor: str) -> tuple[float, float, float, float]:
        w = text_width(text, size)
        x0 = x - w if anchor == "end" else x - w / 2 if anchor == "middle" else x
        return (x0, y - 0.8 * size, x0 + w, y + 0.25 * size)

    def free(self, b: tuple[float, float, float, float], pad: float = 1.0) -> bool:
        return all(b[2] + pad <= o[0] or o[2] + pad <= b[0] or b[3] + pad <= o[1] or o[3] + pad <= b[1]
                   for o in self.boxes)

    def text(self, x: float, y: float, text: str, size: float = 11, anchor: str = "start", fill: str = "",
             extra: str = "") -> None:
        self.boxes.append(self.box(x, y, text, size, anchor))
        attrs = f" font-size='{size:g}'" if size != 11 else ""
        attrs += f" text-anchor='{anchor}'" if anchor != "start" else ""
        attrs += f" fill='{fill}'" if fill else ""
        self.body.append(f"<text x='{x:.1f}' y='{y:.1f}'{attrs}{extra}>{_esc(text)}</text>")

    def lines(self, x: float, y: float, text: str, width: float, size: float = 11, **kw: Any) -> float:
        """`text` wrapped to `width`; returns the y below it."""
        for line in _wrap(text, size, width):
            self.text(x, y, line, size, **kw)
            y += size * 1.35
        return y

    def raw(self, element: str) -> None:
        self.body.append(element)

    def svg(self, width: float, height: float) -> str:
        return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
                f"viewBox='0 0 {width:.0f} {height:.0f}' font-family='DejaVu Sans, Arial, sans-serif' "
                f"font-size='11'>\n"
                + "\n".join(self.body) + "\n</svg>\n")


def _write(svg: str, path: Optional[str], title: str) -> str:
    if path is not None:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            if str(path).endswith((".html", ".htm")):
                f.write(f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                        f"</head><body style='font-family:sans-serif'>\n{svg}\n</body></html>\n")
            else:
                f.write(svg)
    return svg


def _legend(c: Canvas, x: float, y: float, width: float, items: Sequence[tuple[str, str]],
            note: str = "") -> float:
    """Colour swatches with names, wrapped inside `width`; returns the y below them."""
    cx = x
    for name, color in items:
        w = 16 + text_width(name) + 18
        if cx > x and cx + w > x + width:
            cx, y = x, y + 18
        c.raw(f"<rect x='{cx:.1f}' y='{y - 10:.1f}' width='12' height='12' fill='{color}'/>")
        c.text(cx + 16, y, name)
        cx += w
    y += 18
    if note:
        y = c.lines(x, y, note, width, fill="#555")
    return y


# -- pipeline timeline ---------------------------------------------------------------------------------------
def render_timeline(timeline: Any, path: Optional[str] = None, title: str = "", unit: str = "s",
                    row_label: str = "rank", estimate: Any = None, grad_sync_s: Any = 0.0,
                    optimizer_s: float = 0.0, fold: Optional[bool] = None, keep: int = 3) -> str:
    """Draw a `timeline.Timeline` (from `timeline.replay`, `Plan.timeline` or `nns.simulate(...,
    keep_timeline=True).timeline`), one row per rank (`row_label` "device" for per-device rows).

    `estimate` (the simulator's) adds each rank's exposed gradient synchronization and its optimizer
    step after its last task (or give `grad_sync_s`, per rank or one number, and `optimizer_s`).
    `fold`: draw the first and last `keep` micro-batches and fold the middle (default: when the
    step has more than 16 micro-batches)."""
    from nnscaler_plugins.plan.timeline import fold_window

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
    fmt = fmt_seconds if unit == "s" else (lambda v: f"{_num(v)} {unit}")
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
              f"stroke-width='0.5'><title>{_esc(tip)}</title></rect>")
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
                  f"stroke='#999'><title>{_esc(f'folded: {fmt(window[1] - window[0])}, busy {100 * busy:.1f} %')}"
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
    y_end = _legend(c, left, axis_y + 30, plot_w, items, note)
    return _write(c.svg(width, y_end + 4), path, title or "pipeline timeline")


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


# -- Pareto curve --------------------------------------------------------------------------------------------
def _points(plans: Any) -> list[tuple[float, float, str, str]]:
    """(time, bytes, words, mark) of a ParetoSet (numbered as its table) or of tuples
    (time, bytes[, words[, mark]])."""
    if hasattr(plans, "estimates"):
        return [(e.step_time_s, e.max_memory_bytes, plan_label(p), f"#{i}")
                for i, (p, e) in enumerate(zip(plans.plans, plans.estimates))]
    out = []
    for i, x in enumerate(plans):
        t, m, *rest = tuple(x)
        out.append((float(t), float(m), str(rest[0]) if rest else "", str(rest[1]) if len(rest) > 1 else f"#{i}"))
    return out


def render_pareto(plans: Any, path: Optional[str] = None, title: str = "", others: Sequence[tuple] = (),
                  memory_limit: Optional[float] = None, max_legend: int = 30) -> str:
    """Step time (x) against peak memory per device (y) of a `ParetoSet` (numbered as its `table()`)
    or of (time, bytes[, words[, mark]]) tuples; `others` are extra labelled points (e.g. fixed
    recipes) drawn hollow; `memory_limit` (bytes per device) is drawn as a line, or noted above
    the chart when it is far above every plan."""
    pts = _points(plans)
    extra = [(float(x[0]), float(x[1]), str(x[2]) if len(x) > 2 else "") for x in others]
    c = Canvas()
    if not pts and not extra:
        c.text(10, 30, "no plans")
        return _write(c.svg(300, 60), path, title)
    times = [p[0] for p in pts] + [p[0] for p in extra]
    mems = [p[1] for p in pts] + [p[1] for p in extra]
    top_mem = max(mems) * 1.12 or 1.0
    limit_on_chart = memory_limit is not None and memory_limit <= 1.6 * max(mems)
    if limit_on_chart:
        top_mem = max(top_mem, memory_limit * 1.08)
    tscale, tname = _unit_for(max(times), _UNITS_S)
    mscale, mname = _unit_for(top_mem, _UNITS_B)
    xt = nice_ticks(max(times) * 1.1 / tscale)
    yt = nice_ticks(top_mem / mscale)
    left, w, h, width = 70, 660, 380, 800
    y = c.lines(16, 24, title or "Plans: step time against peak memory per device", width - 32, size=14)
    y = c.lines(16, y + 2, "lower left is better; each point is a plan, numbered as in plans.table()", width - 32,
                fill="#555")
    c.text(16, y + 8, f"peak memory per device ({mname})")
    top = y + 22
    x1, y1 = xt[-1] * tscale, yt[-1] * mscale

    def sx(t: float) -> float:
        return left + t / x1 * w

    def sy(m: float) -> float:
        return top + h - m / y1 * h

    c.raw(f"<rect x='{left}' y='{top:.1f}' width='{w}' height='{h}' fill='none' stroke='#999'/>")
    for v in xt:
        c.text(sx(v * tscale), top + h + 16, _num(v), anchor="middle")
    for v in yt:
        c.raw(f"<line x1='{left}' x2='{left + w}' y1='{sy(v * mscale):.1f}' y2='{sy(v * mscale):.1f}' stroke='#eee'/>")
        c.text(left - 6, sy(v * mscale) + 4, _num(v), anchor="end")
    c.text(left + w / 2, top + h + 34, f"step time ({tname})", anchor="middle")
    if memory_limit is not None:
        if limit_on_chart:
            ly = sy(memory_limit)
            c.raw(f"<line x1='{left}' x2='{left + w}' y1='{ly:.1f}' y2='{ly:.1f}' stroke='#E45756' "
                  "stroke-dasharray='6 4' stroke-width='1.5'/>")
            c.text(left + w - 4, ly - 4, f"memory limit {fmt_bytes(memory_limit)}", anchor="end", fill="#E45756")
        else:
            c.text(left + w - 4, top - 6, f"memory limit {fmt_bytes(memory_limit)} per device: far above every plan",
                   anchor="end", fill="#E45756")
    front = sorted(pts)
    if len(front) > 1:
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(t):.1f},{sy(m):.1f}" for i, (t, m, *_) in enumerate(front))
        c.raw(f"<path d='{d}' fill='none' stroke='#4C78A8' stroke-dasharray='4 3'/>")
    for t, m, words, mark in pts:
        c.raw(f"<circle cx='{sx(t):.1f}' cy='{sy(m):.1f}' r='5' fill='#4C78A8'><title>"
              f"{_esc(f'{mark}: {fmt_seconds(t)}, {fmt_bytes(m)}: {words}')}</title></circle>")
    for t, m, words in extra:
        c.raw(f"<circle cx='{sx(t):.1f}' cy='{sy(m):.1f}' r='5' fill='none' stroke='#E45756' stroke-width='2'>"
              f"<title>{_esc(f'{words}: {fmt_seconds(t)}, {fmt_bytes(m)}')}</title></circle>")
    # marks next to their points where there is room (the dots themselves count as taken)
    dots = [(sx(t) - 5, sy(m) - 5, sx(t) + 5, sy(m) + 5) for t, m, *_ in pts + extra]
    c.boxes.extend(dots)
    frame = (left + 1, top + 1, left + w - 1, top + h - 1)
    for (t, m, _, mark), fill in [(p, "#222") for p in pts] + [((e[0], e[1], "", e[2]), "#E45756") for e in extra]:
        if not mark:
            continue
        px, py = sx(t), sy(m)
        for dx, dy, anchor in ((8, -7, "start"), (8, 13, "start"), (-8, -7, "end"), (-8, 13, "end"),
                               (0, -11, "middle"), (0, 19, "middle"), (16, 3, "start"), (-16, 3, "end")):
            b = c.box(px + dx, py + dy, mark, 10, anchor)
            if b[0] >= frame[0] and b[2] <= frame[2] and b[1] >= frame[1] and b[3] <= frame[3] and c.free(b):
                c.text(px + dx, py + dy, mark, 10, anchor, fill)
                break
    # the legend: every plan in words
    y = top + h + 58
    c.text(left, y, "plan", 10, fill="#555")
    c.text(left + 40, y, "step time", 10, fill="#555")
    c.text(left + 110, y, "peak memory", 10, fill="#555")
    for t, m, words, mark in pts[:max_legend]:
        y += 15
        c.text(left, y, mark, 10)
        c.text(left + 40, y, fmt_seconds(t), 10)
        c.text(left + 110, y, fmt_bytes(m), 10)
        for i, line in enumerate(_wrap(words, 10, width - left - 200)):
            if i:
                y += 13
            c.text(left + 190, y, line, 10)
    if len(pts) > max_legend:
        y += 15
        c.text(left, y, f"... and {len(pts) - max_legend} more plans (see plans.table())", 10, fill="#555")
    for t, m, words in extra:
        y += 15
        c.text(left, y, f"{words}: {fmt_seconds(t)}, {fmt_bytes(m)} (hollow mark)", 10, fill="#E45756")
    return _write(c.svg(width, y + 14), path, title or "Pareto set")


# -- device map ----------------------------------------------------------------------------------------------
def render_device_map(plan: Any, path: Optional[str] = None, graph: Any = None, title: str = "",
                      max_devices: int = 16) -> str:
    """Rows are devices: the first replica's, then as many whole data-parallel replicas as fit in
    `max_devices` rows (the others are one line of text: they run the same). Columns are the parts
    of the model (ops before the layers, each layer, ops after): a cell is coloured by the pipeline
    stage that runs that part on that device, darker when more of the part's ops are split across
    devices (hover for the counts)."""
    from nnscaler_plugins.plan.layers import layer_groups

    graph = graph if graph is not None else getattr(plan, "graph", None)
    if graph is not None:
        groups = layer_groups(graph)
        parts = ([("pre", [op.name for op in groups.pre])] if groups.pre else []) + \
            [(f"L{i}", [op.name for op in layer]) for i, layer in enumerate(groups.layers)] + \
            ([("post", [op.name for op in groups.post])] if groups.post else [])
        if not groups.layers:
            parts = [("model", [op.name for op in graph.ops])]
    else:
        parts = [("model", list(plan.ops))]
    unit, dp = int(plan.unit_size), int(plan.dp)
    # (replica, unit device); the world rank is replica * unit + device
    replicas = max(1, min(dp, max_devices // max(1, unit)))
    rows = [(r, d) for r in range(replicas) for d in range(min(unit, max(max_devices, 1)))]
    labels = [f"dev {r * unit + d}" + (f" (replica {r})" if dp > 1 and d == 0 else "") for r, d in rows]
    left = 16 + max(text_width(s) for s in labels)
    cw = max(8, min(40, 900 // max(1, len(parts))))
    ch = 18
    width = max(left + cw * len(parts) + 24, 640)
    c = Canvas()
    head = (f"{title or 'device map'}: {_plural(unit, 'device')} per replica x {_plural(dp, 'replica')} = "
            f"{_plural(unit * dp, 'device')}")
    y = c.lines(16, 22, head, width - 32, size=14)
    y = c.lines(16, y + 2, plan_label(plan), width - 32, fill="#333")
    top = y + 22
    last_right = -1e9
    for j, (name, _) in enumerate(parts):
        x = left + j * cw + cw / 2
        b = c.box(x, top - 6, name, 9, "middle")
        if b[0] >= last_right + 3 and b[2] <= width:
            c.text(x, top - 6, name, 9, "middle")
            last_right = b[2]
    for i, (r, d) in enumerate(rows):
        y0 = top + i * ch
        c.text(left - 6, y0 + ch * 0.7, labels[i], anchor="end", fill="#222" if r == 0 else "#666")
        for j, (name, ops) in enumerate(parts):
            on = [n for n in ops if d in plan.ops[n].devices]
            x0 = left + j * cw
            who = f"device {r * unit + d}" + (f" (replica {r}, as unit device {d})" if dp > 1 else "")
            if not on:
                c.raw(f"<rect x='{x0}' y='{y0}' width='{cw - 1}' height='{ch - 1}' fill='#fafafa' stroke='#eee'>"
                      f"<title>{_esc(f'{who}: nothing of {name}')}</title></rect>")
                continue
            stages = sorted({plan.ops[n].stage or 0 for n in on})
            split = sum(1 for n in on if plan.ops[n].splits)
            color = STAGE_COLORS[stages[0] % len(STAGE_COLORS)]
            opacity = (0.45 + 0.55 * split / len(on)) * (1.0 if r == 0 else 0.8)
            names = sorted({lab for n in on for lab, _ in plan.ops[n].splits})
            tip = (f"{who}, {name}: {len(on)} of {len(ops)} ops, {split} split (along {', '.join(names) or '-'}), "
                   f"stage {', '.join(map(str, stages))}")
            c.raw(f"<rect x='{x0}' y='{y0}' width='{cw - 1}' height='{ch - 1}' fill='{color}' "
                  f"fill-opacity='{opacity:.2f}'><title>{_esc(tip)}</title></rect>")
    y = top + ch * len(rows) + 16
    if len(rows) < unit * replicas:
        y = c.lines(16, y, f"devices {len(rows)}..{unit - 1} of replica 0 not drawn", width - 32, fill="#555") + 4
    if replicas < dp:
        y = c.lines(16, y, f"replicas {replicas}..{dp - 1} (devices {replicas * unit}..{dp * unit - 1}) not drawn: "
                    "each runs what replica 0 runs, on its own part of the batch", width - 32, fill="#555") + 4
    stages_used = sorted({p.stage or 0 for p in plan.ops.values()})
    items = [(f"stage {k}", STAGE_COLORS[k % len(STAGE_COLORS)]) for k in stages_used[:10]]
    note = ("Colour: the pipeline stage; darker: more of the part's ops split across devices; empty: the device "
            "runs none of it.")
    if dp > 1:
        note += " Every data-parallel replica runs the same plan on its own part of the batch."
    y = _legend(c, 16, y + 10, width - 32, items, note)
    return _write(c.svg(width, y + 4), path, title or "device map")


def svg_text_boxes(svg: str) -> tuple[tuple[float, float], list[tuple[str, tuple[float, float, float, float]]]]:
    """((width, height), [(text, box)]) of an SVG written here: what tests check for text that leaves
    the frame or overlaps other text."""
    size = re.search(r"viewBox='0 0 ([\d.]+) ([\d.]+)'", svg)
    frame = (float(size.group(1)), float(size.group(2))) if size else (0.0, 0.0)
    out = []
    canvas = Canvas()
    for m in re.finditer(r"<text x='([-\d.]+)' y='([-\d.]+)'([^>]*)>([^<]*)</text>", svg):
        attrs = m.group(3)
        fs = re.search(r"font-size='([\d.]+)'", attrs)
        anchor = re.search(r"text-anchor='(\w+)'", attrs)
        text = html.unescape(m.group(4))
        out.append((text, canvas.box(float(m.group(1)), float(m.group(2)), text, float(fs.group(1)) if fs else 11,
                                     anchor.group(1) if anchor else "start")))
    return frame, out
