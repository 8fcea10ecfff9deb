"""SVG drawing with text that fits: a canvas that remembers where its text went (so labels do not
collide), text widths estimated for a sans-serif font, round axis ticks, legends, and writing a picture
as plain SVG or as an HTML page around it. No dependencies; every picture of the library is drawn
with these (`render`, `plan.timeline_picture`)."""
from __future__ import annotations

import html
import math
import os
import re
from typing import Any, Optional, Sequence

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


def wrap(text: str, size: float, width: float) -> list[str]:
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


def esc(x: Any) -> str:
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
        self.body.append(f"<text x='{x:.1f}' y='{y:.1f}'{attrs}{extra}>{esc(text)}</text>")

    def lines(self, x: float, y: float, text: str, width: float, size: float = 11, **kw: Any) -> float:
        """`text` wrapped to `width`; returns the y below it."""
        for line in wrap(text, size, width):
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


def write_picture(svg: str, path: Optional[str], title: str) -> str:
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


def legend(c: Canvas, x: float, y: float, width: float, items: Sequence[tuple[str, str]],
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
