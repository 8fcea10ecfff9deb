"""`deepspeed.ops`: the optimizer classes scripts import (`deepspeed.ops.adam.FusedAdam`,
`DeepSpeedCPUAdam`, `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`), as torch optimizers computing
DeepSpeed's update, and `__compatible_ops__`, which scripts and tests read to see whether an op
exists: true for those, false for every other DeepSpeed kernel (this engine has none)."""
from __future__ import annotations

from collections import defaultdict

from . import adagrad, adam  # noqa: F401

__compatible_ops__: "defaultdict[str, bool]" = defaultdict(bool, {"fused_adam": True, "cpu_adam": True,
                                                                  "cpu_adagrad": True})

__all__ = ["adam", "adagrad", "__compatible_ops__"]
