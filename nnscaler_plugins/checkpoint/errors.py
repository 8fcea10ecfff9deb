"""The one exception the checkpoint package raises for bad input, so callers can tell a bad
checkpoint (or a save called wrongly) apart from a bug."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message says what and what to do."""
