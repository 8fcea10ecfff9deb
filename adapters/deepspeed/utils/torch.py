"""`deepspeed.utils.torch`: the torch version check scripts use."""
from __future__ import annotations

from typing import Optional

import torch


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def required_torch_version(min_version: Optional[float] = None, max_version: Optional[float] = None) -> bool:
    """Whether the installed torch's major.minor lies within [min_version, max_version]."""
    have = _version(torch.__version__)
    if min_version is not None and have < _version(str(min_version)):
        return False
    if max_version is not None and have > _version(str(max_version)):
        return False
    return True
