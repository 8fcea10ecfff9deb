"""Draws docs/images/layers.svg: the layers of the core, lowest at the bottom, read from the import
contract in tests/test_layers.py (`LAYERS`), with the plugins (strategies/, adapters/) above them.
A part may import only the parts drawn below it; tests/test_docs.py checks the file is up to date.

    python docs/images/layers.py      # rewrites docs/images/layers.svg (then: rsvg-convert -o layers.png layers.svg)
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: What each part holds, in a few words (a part missing here is drawn with its name only).
WORDS = {
    "": "the public names: import nnscaler_plugins as nns",
    "cli": "the nnscaler-plan command: search, explain, simulate, show, render, merge-checkpoint",
    "api": "nns.capture, nns.plan, nns.compile, nns.parallelize, nns.strategies",
    "session": "one job: the plan resolved once, the model captured once, planned, compiled, run",
    "checkpoint": "nns.checkpoint: save, load, export, merge (any plan, any world size)",
    "runtime": "ParallelModule runs artifacts: process groups, gradient reducers, ZeRO, pipelines",
    "compiler": "lower + codegen: one Artifact per rank (nns.compile)",
    "search": "clusters, the cost model and simulator, the Pareto search (nns.search)",
    "codegen": "a Program becomes one readable Python file per rank",
    "render": "pictures: Pareto curve, device map, pipeline timeline",
    "passes": "apply_tp, apply_sp, apply_cp, apply_ep, apply_pp, apply_zero, ... (strategies compose them)",
    "lower": "Plan + Graph: per-device Program with the communication each dependency needs",
    "plan": "Plan, its mesh and knobs, the primitives op_trans / op_assign / op_order, schedules",
    "rules": "dimension signatures: how each op may be split",
    "capture": "torch.export: model + example inputs become a Graph",
    "kernels": "what generated code calls: collectives, group-aware kernels",
}
PLUGIN_ROW = ("strategies/   adapters/", "plugins, registered through hooks; they import only the core's public names")

ROW_H, GAP, LEFT, NAME_W, WIDTH = 30, 6, 70, 210, 900
LINE_H, LINE_CHARS = 14, 92  # a row's further lines, and how many characters of 11 px fit its box
FILL = {"plugins": "#fde2c4", "core": "#dbe8f6", "base": "#e6e6e6"}


def layers() -> list[frozenset]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from test_layers import LAYERS
    finally:
        sys.path.pop(0)
    return LAYERS


def _wrapped(words: str) -> list[str]:
    """The row's text in lines that fit its box, broken after commas or semicolons."""
    lines = [""]
    for piece in words.replace("; ", ";\0").replace(", ", ",\0").split("\0"):
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > LINE_CHARS:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return lines


def draw() -> str:
    sys.path.insert(0, ROOT)
    try:
        from nnscaler_plugins.svg import Canvas
    finally:
        sys.path.pop(0)
    contract = layers()
    rows = [("plugins", PLUGIN_ROW[0], PLUGIN_ROW[1])]
    for i, layer in reversed(list(enumerate(contract))):
        parts = sorted(layer)
        if i == 0:
            rows.append(("base", "base modules", ", ".join(parts)))
        else:
            name = " ".join("nnscaler_plugins/__init__.py" if p == "" else f"{p}/" if p not in ("api", "cli", "session", "render")
                            else f"{p}.py" for p in parts)
            rows.append(("core", name, "; ".join(WORDS.get(p, p) for p in parts)))
    c = Canvas()
    c.text(LEFT, 24, "nnscaler-plugins: the layers (each imports only the layers below it)", size=14)
    y = 44
    for kind, name, words in rows:
        lines = _wrapped(words)
        height = ROW_H + LINE_H * (len(lines) - 1)
        c.raw(f"<rect x='{LEFT}' y='{y}' width='{WIDTH - LEFT - 16}' height='{height}' rx='4' fill='{FILL[kind]}' "
              f"stroke='#8899aa'/>")
        c.text(LEFT + 8, y + 19, name, size=12, extra=" font-weight='bold'")
        for k, line in enumerate(lines):
            c.text(LEFT + NAME_W + 8, y + 19 + LINE_H * k, line, size=11)
        y += height + GAP
    # the arrow of imports, down the left side
    top, bottom = 44 + ROW_H // 2, y - GAP - ROW_H // 2
    c.raw(f"<line x1='36' y1='{top}' x2='36' y2='{bottom - 8}' stroke='#445' stroke-width='2'/>")
    c.raw(f"<polygon points='30,{bottom - 10} 42,{bottom - 10} 36,{bottom}' fill='#445'/>")
    c.text(24, (top + bottom) / 2, "imports", size=11, anchor="middle",
           extra=f" transform='rotate(-90 24 {(top + bottom) / 2:.1f})'")
    c.text(LEFT, y + 14, "Data flows capture -> plan -> lower -> codegen/compile -> runtime -> adapters; "
           "tests/test_layers.py keeps the imports so.", size=11, fill="#555")
    return c.svg(WIDTH, y + 26)


if __name__ == "__main__":
    path = os.path.join(HERE, "layers.svg")
    with open(path, "w") as f:
        f.write(draw())
    print(f"wrote {path}")
