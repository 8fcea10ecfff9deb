"""Pictures of plans a person opens in a browser: SVG (or HTML around the SVG), no dependencies.

    render_timeline(timeline, "timeline.svg")        # one row per pipeline rank, one box per task
    render_pareto(pareto_set, "pareto.svg")          # step time against peak memory per device
    render_device_map(plan, "devices.html")          # which device runs which parts of the model

Every function takes a destination path, writes the file (".html" wraps the SVG in a page, any
other name gets plain SVG) and returns the SVG text. Boxes carry <title> tooltips with the exact
numbers, so hovering shows what a box is.

`render_timeline(timeline, path, title="")` draws a `timeline.Timeline` (from `timeline.replay`,
`timeline.check` or `nns.simulate(..., keep_timeline=True).timeline`): forward tasks blue, backward
green, weight-gradient purple, forwards without gradients grey; the gaps between boxes are the
pipeline's bubbles and are left empty on a light band, so idle time is visible at a glance.
"""
from __future__ import annotations

import html
import os
from typing import Any, Optional, Sequence

COLORS = {"F": "#4C78A8", "B": "#54A24B", "W": "#B279A2", "F~": "#BAB0AC"}
STAGE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                "#9D755D", "#BAB0AC"]


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


def _svg(width: float, height: float, body: list[str]) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}' font-family='sans-serif' font-size='11'>\n"
            + "\n".join(body) + "\n</svg>\n")


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _nice(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.3g}"
    return f"{x:.3g}"


# -- pipeline timeline ---------------------------------------------------------------------------------------
def render_timeline(timeline: Any, path: Optional[str] = None, title: str = "", unit: str = "s",
                    row_label: str = "rank") -> str:
    """Draw a `timeline.Timeline`: one row per pipeline rank (or per device, with `row_label`
    "device" for `Plan.timeline(per_device=True)`), one box per task, bubbles as gaps."""
    events = timeline.events
    span = timeline.makespan or 1.0
    left, top, row_h, gap = 70, 40, 26, 6
    width = 1100
    plot_w = width - left - 20
    height = top + len(events) * (row_h + gap) + 50
    scale = plot_w / span
    body = [f"<text x='{left}' y='20' font-size='14'>{_esc(title or 'pipeline timeline')}</text>"]
    bubble = timeline.bubble_fraction() if hasattr(timeline, "bubble_fraction") else 0.0
    body.append(f"<text x='{width - 20}' y='20' text-anchor='end'>step {_nice(span)} {unit}, bubble "
                f"{100 * bubble:.1f} %</text>")
    for r, evs in enumerate(events):
        y = top + r * (row_h + gap)
        body.append(f"<rect x='{left}' y='{y}' width='{plot_w:.1f}' height='{row_h}' fill='#f3f3f3'/>")
        body.append(f"<text x='{left - 8}' y='{y + row_h * 0.65:.1f}' text-anchor='end'>{_esc(row_label)} {r}</text>")
        for e in evs:
            t = e.task
            key = t.kind if t.grad else "F~"
            x, w = left + e.start * scale, max((e.end - e.start) * scale, 0.5)
            label = str(t)
            tip = f"{label}: stage {t.stage}, micro-batch {t.micro_batch}, {_nice(e.start)} to {_nice(e.end)} {unit}"
            body.append(f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{row_h}' fill='{COLORS[key]}' "
                        f"stroke='white' stroke-width='0.5'><title>{_esc(tip)}</title></rect>")
            if w > 7 * len(label):
                body.append(f"<text x='{x + w / 2:.2f}' y='{y + row_h * 0.65:.1f}' text-anchor='middle' "
                            f"fill='white'>{_esc(label)}</text>")
    axis_y = top + len(events) * (row_h + gap) + 12
    for i in range(6):
        t = span * i / 5
        x = left + t * scale
        body.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{top - 4}' y2='{axis_y - 8}' stroke='#ddd'/>")
        body.append(f"<text x='{x:.1f}' y='{axis_y + 4}' text-anchor='middle'>{_nice(t)} {unit}</text>")
    lx = left
    for name, key in (("forward", "F"), ("backward", "B"), ("weight gradient", "W"), ("no-grad forward", "F~")):
        body.append(f"<rect x='{lx}' y='{axis_y + 14}' width='12' height='12' fill='{COLORS[key]}'/>")
        body.append(f"<text x='{lx + 16}' y='{axis_y + 24}'>{name}</text>")
        lx += 130
    body.append(f"<text x='{lx}' y='{axis_y + 24}' fill='#888'>empty band = bubble (idle)</text>")
    return _write(_svg(width, height + 20, body), path, title or "pipeline timeline")


# -- Pareto curve --------------------------------------------------------------------------------------------
def render_pareto(plans: Any, path: Optional[str] = None, title: str = "", others: Sequence[tuple] = ()) -> str:
    """Step time (x) against peak memory per device (y) of a `ParetoSet` (or (time, bytes, label)
    tuples); `others` are extra labelled points (e.g. fixed recipes) drawn as hollow marks."""
    if hasattr(plans, "estimates"):
        pts = [(e.step_time_s, e.max_memory_bytes, p.options.get("summary", p.strategy))
               for p, e in zip(plans.plans, plans.estimates)]
    else:
        pts = [tuple(x) for x in plans]
    allpts = pts + [tuple(x) for x in others]
    gib = 1024 ** 3
    if not allpts:
        return _write(_svg(300, 60, ["<text x='10' y='30'>no plans</text>"]), path, title)
    xs = [p[0] for p in allpts]
    ys = [p[1] / gib for p in allpts]
    x0, x1 = 0.0, max(xs) * 1.1
    y0, y1 = 0.0, max(ys) * 1.15 or 1.0
    left, top, w, h = 80, 40, 700, 420
    sx = lambda x: left + (x - x0) / (x1 - x0 or 1) * w  # noqa: E731
    sy = lambda y: top + h - (y - y0) / (y1 - y0 or 1) * h  # noqa: E731
    body = [f"<text x='{left}' y='22' font-size='14'>{_esc(title or 'Pareto set: step time vs peak memory')}</text>",
            f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='none' stroke='#999'/>"]
    for i in range(6):
        xv, yv = x0 + (x1 - x0) * i / 5, y0 + (y1 - y0) * i / 5
        body.append(f"<text x='{sx(xv):.1f}' y='{top + h + 16}' text-anchor='middle'>{_nice(xv)}</text>")
        body.append(f"<text x='{left - 6}' y='{sy(yv) + 4:.1f}' text-anchor='end'>{_nice(yv)}</text>")
        body.append(f"<line x1='{left}' x2='{left + w}' y1='{sy(yv):.1f}' y2='{sy(yv):.1f}' stroke='#eee'/>")
    body.append(f"<text x='{left + w / 2}' y='{top + h + 34}' text-anchor='middle'>step time (s)</text>")
    body.append(f"<text x='20' y='{top + h / 2}' transform='rotate(-90 20 {top + h / 2})' text-anchor='middle'>"
                "peak memory per device (GiB)</text>")
    front = sorted(pts)
    if len(front) > 1:
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(t):.1f},{sy(m / gib):.1f}" for i, (t, m, *_) in enumerate(front))
        body.append(f"<path d='{d}' fill='none' stroke='#4C78A8' stroke-dasharray='4 3'/>")
    for i, (t, m, *rest) in enumerate(pts):
        label = rest[0] if rest else f"plan {i}"
        body.append(f"<circle cx='{sx(t):.1f}' cy='{sy(m / gib):.1f}' r='5' fill='#4C78A8'><title>"
                    f"{_esc(f'#{i}: {_nice(t)} s, {m / gib:.2f} GiB: {label}')}</title></circle>")
        body.append(f"<text x='{sx(t) + 7:.1f}' y='{sy(m / gib) - 6:.1f}' font-size='10'>#{i}</text>")
    for t, m, *rest in others:
        label = rest[0] if rest else ""
        body.append(f"<circle cx='{sx(t):.1f}' cy='{sy(m / gib):.1f}' r='5' fill='none' stroke='#E45756' "
                    f"stroke-width='2'><title>{_esc(f'{label}: {_nice(t)} s, {m / gib:.2f} GiB')}</title></circle>")
        body.append(f"<text x='{sx(t) + 7:.1f}' y='{sy(m / gib) + 12:.1f}' font-size='10' fill='#E45756'>"
                    f"{_esc(label)}</text>")
    legend_y = top + h + 50
    for i, (t, m, *rest) in enumerate(pts[:12]):
        label = rest[0] if rest else ""
        body.append(f"<text x='{left}' y='{legend_y + 14 * i}' font-size='10'>#{i}: {_nice(t)} s, "
                    f"{m / gib:.2f} GiB  {_esc(label)}</text>")
    height = legend_y + 14 * min(len(pts), 12) + 10
    return _write(_svg(left + w + 40, height, body), path, title or "Pareto set")


# -- device map ----------------------------------------------------------------------------------------------
def render_device_map(plan: Any, path: Optional[str] = None, graph: Any = None, title: str = "",
                      max_devices: int = 64) -> str:
    """Rows are the unit's devices, columns the parts of the model (ops before the layers, each
    layer, ops after): a cell is coloured by the pipeline stage that runs that part on that device,
    and says how its ops are split there (hover for the counts)."""
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
    devices = list(range(min(plan.unit_size, max_devices)))
    left, top, cw, ch = 70, 50, max(8, min(40, 900 // max(1, len(parts)))), 18
    width = left + cw * len(parts) + 30
    height = top + ch * len(devices) + 60
    body = [f"<text x='{left}' y='20' font-size='14'>{_esc(title or 'device map')}: {plan.unit_size} devices per "
            f"replica x {plan.dp} replica(s)</text>"]
    for j, (name, _) in enumerate(parts):
        if cw >= 16 or j % max(1, 16 // cw) == 0:
            body.append(f"<text x='{left + j * cw + cw / 2:.1f}' y='{top - 6}' text-anchor='middle' font-size='9'>"
                        f"{_esc(name)}</text>")
    for d in devices:
        y = top + d * ch
        body.append(f"<text x='{left - 6}' y='{y + ch * 0.7:.1f}' text-anchor='end'>dev {d}</text>")
        for j, (name, ops) in enumerate(parts):
            on = [n for n in ops if d in plan.ops[n].devices]
            if not on:
                body.append(f"<rect x='{left + j * cw}' y='{y}' width='{cw - 1}' height='{ch - 1}' fill='#fafafa' "
                            f"stroke='#eee'><title>{_esc(f'device {d}: nothing of {name}')}</title></rect>")
                continue
            stages = sorted({plan.ops[n].stage or 0 for n in on})
            split = sum(1 for n in on if plan.ops[n].splits)
            color = STAGE_COLORS[stages[0] % len(STAGE_COLORS)]
            opacity = 0.45 + 0.55 * split / len(on)
            labels = sorted({l for n in on for l, _ in plan.ops[n].splits})
            tip = (f"device {d}, {name}: {len(on)} of {len(ops)} ops, {split} split (along {', '.join(labels) or '-'}), "
                   f"stage {', '.join(map(str, stages))}")
            body.append(f"<rect x='{left + j * cw}' y='{y}' width='{cw - 1}' height='{ch - 1}' fill='{color}' "
                        f"fill-opacity='{opacity:.2f}'><title>{_esc(tip)}</title></rect>")
    if plan.unit_size > len(devices):
        body.append(f"<text x='{left}' y='{top + ch * len(devices) + 14}'>... {plan.unit_size - len(devices)} more "
                    "devices</text>")
    ly = top + ch * len(devices) + 32
    body.append(f"<text x='{left}' y='{ly}' fill='#555'>colour: pipeline stage; darker: more of the part's ops split "
                "across devices; empty: the device runs none of it</text>")
    return _write(_svg(max(width, 620), height, body), path, title or "device map")
