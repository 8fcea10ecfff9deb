"""Pictures of plans a person opens in a browser: SVG (or HTML around the SVG), no dependencies.

    render_timeline(timeline, "timeline.svg", estimate=est)   # one row per pipeline rank, one box per task
    render_pareto(pareto_set, "pareto.svg", memory_limit=40 * 2**30)   # step time against peak memory
    render_device_map(plan, "devices.html")                   # which device runs which parts of the model

Every function takes a destination path, writes the file (".html" wraps the SVG in a page, any
other name gets plain SVG) and returns the SVG text. Boxes carry <title> tooltips with the exact
numbers, so hovering shows what a box is; what is printed is rounded, with units (ms, MiB), for
reading at a glance.

Text is laid out with an estimate of its width (`svg.text_width`), so nothing is drawn past the
frame and labels that would collide are moved or left to the legend; tests check that on rendered
pictures. Plans are named in words (`plan_label`: "tp 4 x pp 2 x dp 8, 1F1B, ZeRO-2, no
recompute"), the same words and numbers as `ParetoSet.table()`. The timeline picture lives with the
plan's timeline (`plan/timeline_picture.py`) and is re-exported here with the words and units.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from nnscaler_plugins.plan.label import SCHEDULES, plan_label
from nnscaler_plugins.plan.layers import layer_groups
from nnscaler_plugins.plan.timeline_picture import COLORS, render_timeline
from nnscaler_plugins.svg import Canvas, esc, legend, nice_ticks, svg_text_boxes, text_width, wrap, write_picture
from nnscaler_plugins.units import UNITS_B, UNITS_S, fmt_bytes, fmt_seconds, number, plural, unit_for

STAGE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
                "#9D755D", "#BAB0AC"]

__all__ = ["render_timeline", "render_pareto", "render_device_map", "plan_label", "fmt_seconds", "fmt_bytes",
           "text_width", "nice_ticks", "svg_text_boxes", "COLORS", "SCHEDULES", "STAGE_COLORS", "Canvas"]


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
        return write_picture(c.svg(300, 60), path, title)
    times = [p[0] for p in pts] + [p[0] for p in extra]
    mems = [p[1] for p in pts] + [p[1] for p in extra]
    top_mem = max(mems) * 1.12 or 1.0
    limit_on_chart = memory_limit is not None and memory_limit <= 1.6 * max(mems)
    if limit_on_chart:
        top_mem = max(top_mem, memory_limit * 1.08)
    tscale, tname = unit_for(max(times), UNITS_S)
    mscale, mname = unit_for(top_mem, UNITS_B)
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
        c.text(sx(v * tscale), top + h + 16, number(v), anchor="middle")
    for v in yt:
        c.raw(f"<line x1='{left}' x2='{left + w}' y1='{sy(v * mscale):.1f}' y2='{sy(v * mscale):.1f}' stroke='#eee'/>")
        c.text(left - 6, sy(v * mscale) + 4, number(v), anchor="end")
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
              f"{esc(f'{mark}: {fmt_seconds(t)}, {fmt_bytes(m)}: {words}')}</title></circle>")
    for t, m, words in extra:
        c.raw(f"<circle cx='{sx(t):.1f}' cy='{sy(m):.1f}' r='5' fill='none' stroke='#E45756' stroke-width='2'>"
              f"<title>{esc(f'{words}: {fmt_seconds(t)}, {fmt_bytes(m)}')}</title></circle>")
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
        for i, line in enumerate(wrap(words, 10, width - left - 200)):
            if i:
                y += 13
            c.text(left + 190, y, line, 10)
    if len(pts) > max_legend:
        y += 15
        c.text(left, y, f"... and {len(pts) - max_legend} more plans (see plans.table())", 10, fill="#555")
    for t, m, words in extra:
        y += 15
        c.text(left, y, f"{words}: {fmt_seconds(t)}, {fmt_bytes(m)} (hollow mark)", 10, fill="#E45756")
    return write_picture(c.svg(width, y + 14), path, title or "Pareto set")


# -- device map ----------------------------------------------------------------------------------------------
def render_device_map(plan: Any, path: Optional[str] = None, graph: Any = None, title: str = "",
                      max_devices: int = 16) -> str:
    """Rows are devices: the first replica's, then as many whole data-parallel replicas as fit in
    `max_devices` rows (the others are one line of text: they run the same). Columns are the parts
    of the model (ops before the layers, each layer, ops after): a cell is coloured by the pipeline
    stage that runs that part on that device, darker when more of the part's ops are split across
    devices (hover for the counts)."""
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
    head = (f"{title or 'device map'}: {plural(unit, 'device')} per replica x {plural(dp, 'replica')} = "
            f"{plural(unit * dp, 'device')}")
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
                      f"<title>{esc(f'{who}: nothing of {name}')}</title></rect>")
                continue
            stages = sorted({plan.ops[n].stage or 0 for n in on})
            split = sum(1 for n in on if plan.ops[n].splits)
            color = STAGE_COLORS[stages[0] % len(STAGE_COLORS)]
            opacity = (0.45 + 0.55 * split / len(on)) * (1.0 if r == 0 else 0.8)
            names = sorted({lab for n in on for lab, _ in plan.ops[n].splits})
            tip = (f"{who}, {name}: {len(on)} of {len(ops)} ops, {split} split (along {', '.join(names) or '-'}), "
                   f"stage {', '.join(map(str, stages))}")
            c.raw(f"<rect x='{x0}' y='{y0}' width='{cw - 1}' height='{ch - 1}' fill='{color}' "
                  f"fill-opacity='{opacity:.2f}'><title>{esc(tip)}</title></rect>")
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
    y = legend(c, 16, y + 10, width - 32, items, note)
    return write_picture(c.svg(width, y + 4), path, title or "device map")
