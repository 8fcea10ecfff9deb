"""`deepspeed.runtime.engine`: the engine class scripts check against (`isinstance(e, DeepSpeedEngine)`)."""
from ..engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
