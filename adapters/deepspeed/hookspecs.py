"""The DeepSpeed drop-in's own hook, declared by the drop-in (the core never calls it)."""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.hookspecs import hookspec


class DeepSpeedHooks:
    @hookspec(firstresult=True)
    def nnscaler_translate_deepspeed_config(self, config: dict) -> Optional[Any]:
        """Translate a DeepSpeed JSON config (already loaded into a dict) into this project's settings.

        The DeepSpeed drop-in engine calls this once per `initialize`, so a plugin can support keys
        the built-in translation refuses (or refuse keys it accepts). Return a dict with the
        translated settings, or None to leave the config to the next implementation; the first
        non-None result wins. Keys that cannot be honoured must be refused or warned about by name,
        never dropped.
        """
