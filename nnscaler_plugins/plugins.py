"""The plugin manager: built-ins and third-party plugins are loaded the same way, by entry point."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "nnscaler_plugins"


class _CoreDefaults:
    """Fallbacks the core itself provides, registered last so any plugin can override them."""

    @hookspecs.hookimpl(trylast=True)
    def nnscaler_choose_backend(self, device_type: str) -> Optional[str]:
        return "nccl" if device_type == "cuda" else "gloo"

    @hookspecs.hookimpl(trylast=True)
    def nnscaler_adapt_model_for_capture(self, model: Any, kwargs: dict) -> Optional[Any]:
        # Models with a `config.use_cache` (Hugging Face style) would otherwise return a KV cache
        # object from forward, which is neither capturable nor useful in training.
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "use_cache", False):
            return _temporarily(cfg, "use_cache", False)
        return None


@contextlib.contextmanager
def _temporarily(obj: Any, attr: str, value: Any):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("nnscaler_plugins")
    pm.add_hookspecs(hookspecs)
    pm.register(_CoreDefaults(), name="nnscaler_plugins.core")
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def register(plugin: Any, name: Optional[str] = None) -> None:
    """Register a plugin object or module at run time (tests, notebooks)."""
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    _strategy_table.cache_clear()


def unregister(plugin: Any) -> None:
    get_plugin_manager().unregister(plugin)
    _strategy_table.cache_clear()


@functools.lru_cache(maxsize=1)
def _strategy_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    pm = get_plugin_manager()
    for impl in pm.hook.nnscaler_register_strategies.get_hookimpls():
        result = impl.function()
        for name, fn in (result or {}).items():
            if name in table:
                raise ValueError(f"strategy {name!r} is registered twice (second by plugin {impl.plugin_name!r})")
            table[name] = fn
    return table


def strategies() -> list[str]:
    """Names of all registered strategies, sorted."""
    return sorted(_strategy_table())


def get_strategy(name: str) -> Callable:
    table = _strategy_table()
    if name not in table:
        raise KeyError(f"unknown strategy {name!r}; registered: {', '.join(sorted(table)) or '(none)'}")
    return table[name]
