"""Progress for work a person waits on: searches, calibration, capture of large models, training loops.

One small in-house implementation, used everywhere, so every wait looks the same and the core needs
no terminal library. It writes to stderr unless told otherwise and adapts to where it writes:

- on a terminal, one line redrawn in place (carriage returns), at most ten times a second;
- anywhere else (a log file, a pipe, a CI job), whole lines: at the start of each phase, then at
  most every `every_s` seconds, and at the end; a log never fills with carriage returns.
  `inplace=False` asks for lines on a terminal too, for output that mixes progress with other lines.

Nothing is shown before `delay_s` has passed, so work that finishes quickly stays silent; the
closing line ("done in N s") is printed when something was shown, when the work outlasted
`delay_s` (a phase with no steps to report along the way still says what took the time), or when
`always` is set.

    bar = Progress("search", total=40)
    bar.set("intra-op choices", total=40)
    for job in jobs:
        ...; bar.step()
    bar.close("5 plans")

    with phase("measuring this machine", always=True):   # "... done in 9.8 s"
        measure()

    for step, batch in progress(batches, "training"):       # a Progress over an iterable
        ...
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterable, Iterator, Optional, TextIO, TypeVar

T = TypeVar("T")


def seconds(s: float) -> str:
    """A duration as people write it: 850 ms, 4.2 s, 3 min 05 s."""
    if s < 1.0:
        return f"{s * 1e3:.0f} ms"
    if s < 60.0:
        return f"{s:.1f} s"
    m, r = divmod(int(round(s)), 60)
    return f"{m} min {r:02d} s"


class Progress:
    """A counter with phases, shown as a bar on a terminal and as throttled lines elsewhere."""

    def __init__(self, label: str, total: Optional[int] = None, enabled: bool = True,
                 stream: Optional[TextIO] = None, delay_s: float = 1.0, width: int = 30,
                 every_s: float = 5.0, always: bool = False, inplace: Optional[bool] = None):
        self.label = label
        self.total = max(1, total) if total else None
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s, self.width, self.every_s, self.always = delay_s, width, every_s, always
        isatty = getattr(self.stream, "isatty", None)
        self.inplace = bool(isatty and isatty()) if inplace is None else inplace
        self.start = time.monotonic()
        self.done = 0
        self.phase = ""
        self.note = ""
        self.shown = False
        self._last = float("-inf")
        self._dirty = False  # an in-place line is on screen and needs a newline before other output

    # -- feeding ---------------------------------------------------------------------------------------
    def set(self, phase: str, total: Optional[int] = None) -> None:
        """Start a phase (its own count when `total` is given); shown at once once the delay is over."""
        self.phase, self.note = phase, ""
        if total is not None:
            self.total, self.done = max(1, total), 0
        self.draw(force=True)

    def step(self, n: int = 1, note: str = "") -> None:
        """Count `n` more done; `note` (e.g. "loss 6.21") is shown after the count."""
        self.done = self.done + n if self.total is None else min(self.total, self.done + n)
        if note:
            self.note = note
        self.draw(force=self.total is not None and self.done == self.total)

    # -- drawing ---------------------------------------------------------------------------------------
    def _text(self, now: float) -> str:
        if self.total is None and not (self.done or self.phase or self.note):
            took = now - self.start
            return f"{self.label} ..." + (f" {seconds(took)}" if took >= 1.0 else "")
        parts = [f"{self.label}:"]
        if self.total is not None:
            frac = self.done / self.total
            if self.inplace:
                filled = int(frac * self.width)
                parts.append(f"[{'#' * filled}{'.' * (self.width - filled)}]")
            parts.append(f"{100 * frac:3.0f}% ({self.done}/{self.total})")
        elif self.done:
            parts.append(str(self.done))
        if self.phase:
            parts.append(self.phase)
        if self.note:
            parts.append(self.note)
        parts.append(seconds(now - self.start))
        return " ".join(parts)

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay_s and not self.always:
            return
        gap = 0.1 if self.inplace else self.every_s
        if not force and now - self._last < gap:
            return
        self._last = now
        text = self._text(now)
        if self.inplace:
            self.stream.write("\r" + text.ljust(100))
            self._dirty = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def close(self, message: str = "") -> None:
        """The closing line, with the elapsed time; only if anything was shown, the work outlasted
        the delay, or `always`."""
        elapsed = time.monotonic() - self.start
        if not self.enabled or not (self.shown or self.always or elapsed >= self.delay_s):
            return
        took = seconds(elapsed)
        text = f"{self.label}: done in {took}" + (f". {message}" if message else "")
        if self.inplace:
            self.stream.write("\r" + text.ljust(100) + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._dirty = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        elif self._dirty:
            self.stream.write("\n")
            self.stream.flush()


def progress(items: Iterable[T], label: str, total: Optional[int] = None, **kw: Any) -> Iterator[T]:
    """Iterate `items` with a Progress over them (total from len() when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    bar = Progress(label, total, **kw)
    for item in items:
        yield item
        bar.step()
    bar.close()


@contextlib.contextmanager
def phase(label: str, enabled: bool = True, stream: Optional[TextIO] = None, delay_s: float = 2.0,
          always: bool = False) -> Iterator[Progress]:
    """One piece of work without a count (capturing a model, measuring the machine).

    Says "<label> ..." once `delay_s` has passed without the work finishing (at once with
    `always`), and "<label>: done in N s" at the end if it said anything. Quiet work stays quiet
    because nothing runs in the background: a phase that is still going is reported when the code
    inside calls `bar.step()` or `bar.set(...)`, or at its end. Capture, for example, should wrap
    its tracing in `with phase(f"capturing {model_class}")` and call `step()` per traced layer.
    """
    bar = Progress(label, None, enabled=enabled, stream=stream, delay_s=delay_s, always=always)
    if always:
        bar.draw(force=True)
    with bar:
        yield bar
