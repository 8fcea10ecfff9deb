"""Shared fixtures: one set of real worker processes (one process group) per world size for the
whole session: interpreter, torch and gloo start-up dominate on 2 cores. A module whose work
changes process-wide state (importing DeepSpeed patches torch functions) overrides these with
module-scoped fixtures of its own."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import Workers  # noqa: E402


@pytest.fixture(scope="session")
def workers2() -> Iterator[Workers]:
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="session")
def workers4() -> Iterator[Workers]:
    with Workers(4) as w:
        yield w
