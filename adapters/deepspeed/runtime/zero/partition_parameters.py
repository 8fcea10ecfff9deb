"""`deepspeed.runtime.zero.partition_parameters`: where DeepSpeed defines the ZeRO-3 names."""
from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
