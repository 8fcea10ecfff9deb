"""Shared fixtures: one set of real worker processes (one process group) per test module."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import Workers  # noqa: E402


@pytest.fixture(scope="module")
def workers2() -> Iterator[Workers]:
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="module")
def workers4() -> Iterator[Workers]:
    with Workers(4) as w:
        yield w
