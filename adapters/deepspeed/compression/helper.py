"""`deepspeed.compression.helper`: `recursive_getattr` / `recursive_setattr`, which DeepSpeed-Chat's
LoRA helper imports from here (DeepSpeed 0.19 keeps them at this path, living in
`deepspeed.utils.module_utils`)."""
from ..utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
