"""The error the DeepSpeed drop-in raises for a config it cannot run as DeepSpeed would; every
module of the drop-in raises it, so it lives below them all."""
from __future__ import annotations


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config this engine cannot run as DeepSpeed would."""


class DeepSpeedAssertion(DeepSpeedConfigError, AssertionError):
    """A config error DeepSpeed reports with `assert` (inconsistent batch sizes, ...): scripts and
    tests that catch AssertionError, as DeepSpeed's own do, catch it here too."""
