"""`deepspeed.runtime.zero`: the ZeRO-3 parameter marks and contexts (see ../../zero.py)."""
from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter
from . import partition_parameters, utils  # noqa: F401

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
