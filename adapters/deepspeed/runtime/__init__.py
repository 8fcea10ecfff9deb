"""`deepspeed.runtime` as scripts import from it: the schedules, config names, the engine class,
the ZeRO-3 parameter names and exception (the drop-in's own objects under DeepSpeed's paths)."""
from . import config, engine, lr_schedules, pipe, utils, zero  # noqa: F401

__all__ = ["config", "engine", "lr_schedules", "pipe", "utils", "zero"]
