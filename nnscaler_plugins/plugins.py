"""The plugin manager: the built-ins and third-party plugins are registered the same way.

The built-in strategies and adapters are modules named in `BUILTIN_PLUGINS` (one list, as datasette
keeps its default plugins): the manager imports them by name and registers them like any plugin;
the core's code never imports them. Third-party plugins are found through the `nnscaler_plugins`
entry-point group, declared in their package's pyproject:

    [project.entry-points.nnscaler_plugins]
    my_plugin = "my_package.nnscaler_hooks"

A plugin is a module or object with `@hookimpl` functions (see `hookspecs`). A plugin that needs
hooks of its own (the adapters do) declares them by implementing `nnscaler_add_hookspecs`.

Environment switches (read once, when the manager is first made):

    NNSCALER_PLUGINS_DISABLE_AUTOLOAD=1   load no third-party entry points (the built-ins still load)
    NNSCALER_PLUGINS_BLOCK=name1,name2    never register the plugins with these names
                                          (built-ins included, e.g. "builtin_lightning")
    NNSCALER_PLUGINS_TRACE=1              print every hook call, its arguments and its result to
                                          stderr (pluggy's tracing)
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import sys
from typing import Any, Callable, Optional

import pluggy

from nnscaler_plugins import hookspecs

ENTRY_POINT_GROUP = "nnscaler_plugins"
DISTRIBUTION = "nnscaler-plugins"
ENV_DISABLE_AUTOLOAD = "NNSCALER_PLUGINS_DISABLE_AUTOLOAD"
ENV_BLOCK = "NNSCALER_PLUGINS_BLOCK"
ENV_TRACE = "NNSCALER_PLUGINS_TRACE"

# The built-in plugins, by registration name and module.
BUILTIN_PLUGINS = (
    ("builtin_strategies", "nnscaler_plugins.strategies"),
    ("builtin_lightning", "nnscaler_plugins.adapters.lightning"),
    ("builtin_hf", "nnscaler_plugins.adapters.hf_hooks"),
    ("builtin_deepspeed", "nnscaler_plugins.adapters.deepspeed_hooks"),
)


class PluginLoadError(ImportError):
    """An entry point in the `nnscaler_plugins` group could not be imported."""


class _CoreDefaults:
    """Fallbacks the core itself provides, registered last so any plugin can override them."""

    @hookspecs.hookimpl(trylast=True)
    def nnscaler_choose_backend(self, device_type: str) -> Optional[str]:
        return "nccl" if device_type == "cuda" else "gloo"

    @hookspecs.hookimpl(trylast=True)
    def nnscaler_adapt_model_for_capture(self, model: Any, kwargs: dict) -> Optional[Any]:
        # Models with a `config.use_cache` (Hugging Face style) would otherwise return a KV cache
        # object from forward, which is neither capturable nor useful in training. Submodules may
        # hold their own copy of the config (T5's decoder stack keeps a deep copy with the cache
        # on), so the switch goes to every config in the module tree.
        return _temporarily(_configs_of(model), "use_cache", False)


def _configs_of(model: Any) -> list[Any]:
    """Every distinct `config` object held by the model or one of its submodules (nested configs
    too: an encoder-decoder's `encoder_config`, a multimodal model's `text_config`)."""
    found: dict[int, Any] = {}
    modules = model.modules() if hasattr(model, "modules") else [model]
    for m in modules:
        cfg = getattr(m, "config", None)
        stack = [cfg] if cfg is not None else []
        while stack:
            c = stack.pop()
            if id(c) in found or isinstance(c, (str, bytes, int, float, bool, dict, list, tuple)):
                continue
            found[id(c)] = c
            fields = vars(c) if hasattr(c, "__dict__") else {}
            stack.extend(v for k, v in fields.items() if k.endswith("config") and hasattr(v, "__dict__"))
    return list(found.values())


@contextlib.contextmanager
def _temporarily(objs: list[Any], attr: str, value: Any):
    """Set `attr` to `value` on every object that has it, and restore each one afterwards."""
    changed = []
    try:
        for obj in objs:
            if hasattr(obj, attr) and getattr(obj, attr) != value:
                changed.append((obj, getattr(obj, attr)))
                setattr(obj, attr, value)
        yield
    finally:
        for obj, old in reversed(changed):
            setattr(obj, attr, old)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _blocked_names() -> list[str]:
    return [n.strip() for n in os.environ.get(ENV_BLOCK, "").split(",") if n.strip()]


def _entry_points() -> list[tuple[str, str, str]]:
    """(name, module:object value, distribution name) of every third-party entry point in our group."""
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else "?"
        if _normalize(name) != _normalize(DISTRIBUTION):  # an older install of ours may still list built-ins
            out.append((ep.name, ep.value, name))
    return out


def _normalize(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-")


def _load(name: str, value: str, dist: str) -> Any:
    module_name, _, attr = value.partition(":")
    try:
        obj = importlib.import_module(module_name.strip())
        for part in attr.strip().split(".") if attr.strip() else ():
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any failure of third-party code gets the same guidance
        raise PluginLoadError(
            f"nnscaler_plugins: plugin {name!r} (entry point {value!r} of distribution {dist!r}) failed to load: "
            f"{type(e).__name__}: {e}. Fix or uninstall {dist!r}, or skip it with {ENV_BLOCK}={name}") from e
    return obj


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The one plugin manager: core defaults, then built-in and third-party entry points (see the
    module docstring for the environment switches)."""
    pm = pluggy.PluginManager("nnscaler_plugins")
    pm.add_hookspecs(hookspecs)
    if _env_flag(ENV_TRACE):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    for name in _blocked_names():
        pm.set_blocked(name)
    pm.register(_CoreDefaults(), name="nnscaler_plugins.core")
    # Plugins registered from here on may bring hookspecs of their own (historic: every plugin sees it).
    pm.hook.nnscaler_add_hookspecs.call_historic(kwargs={"pluginmanager": pm})
    for name, module in BUILTIN_PLUGINS:
        if not pm.is_blocked(name):
            pm.register(_load(name, module, DISTRIBUTION), name=name)
    if not _env_flag(ENV_DISABLE_AUTOLOAD):
        for name, value, dist in _entry_points():
            if not (pm.is_blocked(name) or pm.has_plugin(name)):
                pm.register(_load(name, value, dist), name=name)
    pm.check_pending()  # a misspelt hook name in any plugin fails here, naming the plugin
    return pm


def plugin_names() -> list[str]:
    """Names of the registered plugins (entry-point names; "nnscaler_plugins.core" for the defaults)."""
    return sorted(name for name, plugin in get_plugin_manager().list_name_plugin() if plugin is not None)


_generation = [0]


def plugins_generation() -> int:
    """A number that changes whenever a plugin is registered or unregistered at run time: tables
    read from the hooks (strategies, op rules) are cached per generation."""
    return _generation[0]


def register(plugin: Any, name: Optional[str] = None) -> None:
    """Register a plugin object or module at run time (tests, notebooks)."""
    get_plugin_manager().register(plugin, name=name)
    _generation[0] += 1


def unregister(plugin: Any) -> None:
    get_plugin_manager().unregister(plugin)
    _generation[0] += 1


def _strategy_table() -> dict[str, Callable]:
    return _strategy_table_for(plugins_generation())


@functools.lru_cache(maxsize=4)
def _strategy_table_for(generation: int) -> dict[str, Callable]:
    pm = get_plugin_manager()
    table: dict[str, Callable] = {}
    clashes: list[str] = []
    # Through the hook relay, so NNSCALER_PLUGINS_TRACE shows the call and what each plugin returned.
    for result in pm.hook.nnscaler_register_strategies():
        for name, fn in (result or {}).items():
            if name in table:
                clashes.append(name)
            table[name] = fn
    if clashes:
        name = clashes[0]
        owners = [impl.plugin_name for impl in pm.hook.nnscaler_register_strategies.get_hookimpls()
                  if name in (impl.function() or {})]
        raise ValueError(f"strategy {name!r} is registered twice (by plugins {', '.join(map(repr, owners))})")
    return table


def strategies() -> list[str]:
    """Names of all registered strategies, sorted."""
    return sorted(_strategy_table())


def get_strategy(name: str) -> Callable:
    table = _strategy_table()
    if name not in table:
        raise KeyError(f"unknown strategy {name!r}; registered: {', '.join(sorted(table)) or '(none)'}")
    return table[name]
