"""A progress bar for searches that take more than a second.

Written to a stream (stderr by default) with carriage returns; nothing is shown until a second has
passed, so quick searches stay silent. No dependency: a search must not need a terminal library.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream: Optional[TextIO] = None,
                 delay_s: float = 1.0, width: int = 30):
        self.label, self.total = label, max(1, total)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self.delay_s, self.width = delay_s, width
        self.done = 0
        self.shown = False
        self.phase = ""
        self._last = 0.0

    def set(self, phase: str, total: Optional[int] = None) -> None:
        self.phase = phase
        if total is not None:
            self.total, self.done = max(1, total), 0
        self.draw(force=True)

    def step(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self.draw(force=self.done == self.total)

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay_s or (not force and now - self._last < 0.1):
            return
        self._last = now
        frac = self.done / self.total
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        self.stream.write(f"\r{self.label}: [{bar}] {100 * frac:3.0f}% {self.phase:<28} {now - self.start:5.1f} s")
        self.stream.flush()
        self.shown = True

    def close(self, message: str = "") -> None:
        if self.shown and self.enabled:
            self.stream.write(f"\r{self.label}: done in {time.monotonic() - self.start:.1f} s. {message}".ljust(100) + "\n")
            self.stream.flush()
