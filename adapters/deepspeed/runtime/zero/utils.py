"""`deepspeed.runtime.zero.utils`: the exception DeepSpeed's ZeRO raises."""
from ...errors import ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
