"""`deepspeed.moe` as scripts import from it: `moe.layer.MoE` (refused when constructed, with what
to use instead) and `moe.utils` (the optimizer-group helpers, DeepSpeed's own logic)."""
from . import layer, utils  # noqa: F401

__all__ = ["layer", "utils"]
