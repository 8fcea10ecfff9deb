"""The error the DeepSpeed drop-in raises for a config it cannot run as DeepSpeed would; every
module of the drop-in raises it, so it lives below them all."""
from __future__ import annotations


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config this engine cannot run as DeepSpeed would."""


class DeepSpeedAssertion(DeepSpeedConfigError, AssertionError):
    """A config error DeepSpeed reports with `assert` (inconsistent batch sizes, ...): scripts and
    tests that catch AssertionError, as DeepSpeed's own do, catch it here too."""


class DeepSpeedNotImplemented(DeepSpeedConfigError, NotImplementedError):
    """A combination DeepSpeed itself rejects with NotImplementedError (an unsupported mix of model
    and gradient-accumulation dtypes): caught as either type."""


class ZeRORuntimeException(DeepSpeedConfigError):
    """DeepSpeed's `deepspeed.runtime.zero.utils.ZeRORuntimeException`, raised where DeepSpeed raises
    it: a client optimizer under offload_optimizer while zero_force_ds_cpu_optimizer is true."""
