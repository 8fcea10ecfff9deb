"""The DeepSpeed drop-in's plugin (registered as `builtin_deepspeed`), kept apart from
`adapters.deepspeed` so that loading plugins does not import the drop-in: its engine, checkpoint
layout and DeepSpeed's module paths are some forty modules, which every process that made a plugin
manager imported (about 2 MiB of memory on each rank) whether or not it read a DeepSpeed config.

It declares the drop-in's hook and gives the built-in translation of a config, which imports the
drop-in's config module when a config is first translated.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.hookspecs import hookimpl, hookspec

PLUGIN_NAME = "builtin_deepspeed"


class DeepSpeedHooks:
    """The DeepSpeed drop-in's own hook, declared by the drop-in (the core never calls it)."""

    @hookspec(firstresult=True)
    def nnscaler_translate_deepspeed_config(self, config: dict) -> Optional[Any]:
        """Translate a DeepSpeed JSON config (already loaded into a dict) into this project's settings.

        The DeepSpeed drop-in engine calls this once per `initialize`, so a plugin can support keys
        the built-in translation refuses (or refuse keys it accepts). Return a dict with the
        translated settings, or None to leave the config to the next implementation; the first
        non-None result wins. Keys that cannot be honoured must be refused or warned about by name,
        never dropped.
        """


@hookimpl
def nnscaler_add_hookspecs(pluginmanager: Any) -> None:
    from nnscaler_plugins.hookspecs import add_hookspecs_once

    add_hookspecs_once(pluginmanager, DeepSpeedHooks)


@hookimpl(trylast=True)
def nnscaler_translate_deepspeed_config(config: dict) -> Optional[dict]:
    """The built-in translation: every key checked against `deepspeed/keys.py`, DeepSpeed's semantics."""
    from .deepspeed.config import translate

    return translate(config).to_dict()
