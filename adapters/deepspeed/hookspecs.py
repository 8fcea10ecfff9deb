"""The DeepSpeed drop-in's own hook. It is declared in `adapters/deepspeed_hooks.py`, the drop-in's
plugin module, so that registering the plugin does not import the drop-in; this name stays for code
that imported it from here."""
from __future__ import annotations

from ..deepspeed_hooks import DeepSpeedHooks

__all__ = ["DeepSpeedHooks"]
