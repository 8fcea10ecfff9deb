"""The plugin manager: built-ins and third-party plugins are loaded the same way, by entry point.

Environment switches (read once, when the manager is first made):

    NNSCALER_PLUGINS_DISABLE_AUTOLOAD=1   load no third-party entry points; the entry points this
                                          distribution declares itself (built-in strategies and
                                          adapters) are still registered
    NNSCALER_PLUGINS_BLOCK=name1,name2    never register the plugins with these entry-point names
                                          (built-ins included, e.g. "builtin_lightning")
    NNSCALER_PLUGINS_TRACE=1              print every hook call, its arguments and its result to
                                          stderr (pluggy's tracing)

A plugin is a module or object with `@hookimpl` functions (see `hookspecs`), declared in its
package's pyproject:

    [project.entry-points.nnscaler_plugins]
    my_plugin = "my_package.nnscaler_hooks"
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata
import inspect
import os
import sys
from typing import Any, Callable, Iterable, Mapping, Optional

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "nnscaler_plugins"
DISTRIBUTION = "nnscaler-plugins"
ENV_DISABLE_AUTOLOAD = "NNSCALER_PLUGINS_DISABLE_AUTOLOAD"
ENV_BLOCK = "NNSCALER_PLUGINS_BLOCK"
ENV_TRACE = "NNSCALER_PLUGINS_TRACE"

# The entries pyproject.toml declares, for a source tree without installed metadata or with metadata
# older than the source (an editable install made before an entry was added): built-ins are always present.
_BUILTIN_FALLBACK = (
    ("builtin_strategies", "nnscaler_plugins.strategies"),
    ("builtin_lightning", "nnscaler_plugins.adapters.lightning"),
    ("builtin_hf", "nnscaler_plugins.adapters.hf_hooks"),
    ("builtin_deepspeed", "nnscaler_plugins.adapters.deepspeed"),
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


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _blocked_names() -> list[str]:
    return [n.strip() for n in os.environ.get(ENV_BLOCK, "").split(",") if n.strip()]


def _entry_points() -> list[tuple[str, str, str]]:
    """(name, module:object value, distribution name) of every entry point in our group; the
    built-ins (declared by this distribution) first, so a third-party plugin cannot take their names."""
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        out.append((ep.name, ep.value, dist.metadata["Name"] if dist is not None else "?"))
    own = [e for e in out if _normalize(e[2]) == _normalize(DISTRIBUTION)]
    seen = {n for n, _, _ in own}
    own += [(n, v, DISTRIBUTION) for n, v in _BUILTIN_FALLBACK if n not in seen]  # stale or missing metadata
    seen = {n for n, _, _ in own}
    return own + [e for e in out if _normalize(e[2]) != _normalize(DISTRIBUTION) and e[0] not in seen]


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
    autoload = not _env_flag(ENV_DISABLE_AUTOLOAD)
    for name, value, dist in _entry_points():
        builtin = _normalize(dist) == _normalize(DISTRIBUTION)
        if pm.is_blocked(name) or pm.has_plugin(name) or not (builtin or autoload):
            continue
        pm.register(_load(name, value, dist), name=name)
    pm.check_pending()  # a misspelt hook name in any plugin fails here, naming the plugin
    return pm


def plugin_names() -> list[str]:
    """Names of the registered plugins (entry-point names; "nnscaler_plugins.core" for the defaults)."""
    return sorted(name for name, plugin in get_plugin_manager().list_name_plugin() if plugin is not None)


def register(plugin: Any, name: Optional[str] = None) -> None:
    """Register a plugin object or module at run time (tests, notebooks)."""
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    _forget_tables()


def unregister(plugin: Any) -> None:
    get_plugin_manager().unregister(plugin)
    _forget_tables()


def _forget_tables() -> None:
    """Strategies and op rules are read from the hooks once; a plugin added later must be seen."""
    _strategy_table.cache_clear()
    from .rules.table import refresh
    refresh()


def example_inputs(model: Any, batch: Any) -> Any:
    """What `model`'s forward takes, built from one real batch by the `nnscaler_example_inputs`
    hook; the batch itself when no plugin knows better."""
    found = get_plugin_manager().hook.nnscaler_example_inputs(model=model, batch=batch)
    return batch if found is None else found


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


# -- strategy options ----------------------------------------------------------------------------------

#: Options every strategy takes, whatever it declares: `nns.plan` consumes them itself (the training
#: knobs set on the plan, the micro-batch count, and what planning for a cluster needs).
COMMON_OPTIONS = frozenset({"zero", "precision", "micro_batches", "micro_batch_size", "cluster", "constraints"})


def strategy_options(strategy: Any) -> Optional[frozenset]:
    """The option names `strategy` takes besides `COMMON_OPTIONS`, or None when they cannot be known.

    A strategy declares them as an `options` attribute (an iterable of names; the built-in `Strategy`
    objects carry one, a plain function may be given one like `degrees`). Without it, a plain
    function takes its keyword parameters (after `builder`), those of its `degrees` function, and,
    when it has no `degrees`, `tp` and `dp` (which `nns.plan` reads to size the unit). A function
    with `**options` and no declaration may take anything: its options are not checked.
    A ready Plan (or plan file) takes no strategy options: `strategy_options(plan) == frozenset()`.
    """
    from .plan import Plan

    if isinstance(strategy, Plan) or isinstance(strategy, os.PathLike) or \
            (isinstance(strategy, str) and strategy.endswith(".json")):
        return frozenset()
    declared = getattr(strategy, "options", None)
    if declared is not None and not callable(declared):
        return frozenset(declared)
    # an object that wraps its function (the built-in `Strategy` without `options`): that function's
    apply = getattr(strategy, "apply", None)
    names = _keyword_parameters(apply if callable(apply) else strategy, skip=1)
    if names is None:
        return None
    degrees = getattr(strategy, "degrees", None)
    if degrees is None:
        names |= {"tp", "dp"}
    else:
        more = _keyword_parameters(degrees, skip=1)
        names |= more or set()
    return frozenset(names)


def _keyword_parameters(fn: Callable, skip: int) -> Optional[set]:
    """Names `fn` takes by keyword, past its first `skip` parameters; None when it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[skip:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _strategy_label(strategy: Any) -> str:
    from .plan import Plan

    if isinstance(strategy, Plan):
        return f"a ready Plan (made by strategy {strategy.strategy!r})"
    if isinstance(strategy, (str, os.PathLike)) and os.fspath(strategy).endswith(".json"):
        return f"the plan file {os.fspath(strategy)!r}"
    if isinstance(strategy, str):
        return f"strategy {strategy!r}"
    name = getattr(strategy, "name", None) or getattr(strategy, "__name__", None) or type(strategy).__name__
    return f"strategy {name!r}"


def check_options(strategy: Any, options: Mapping[str, Any], where: str = "") -> None:
    """Refuse option names `strategy` does not take (a strategy name, callable, Plan or plan file),
    each with the closest valid name; `where` prefixes the message (e.g. "NNScalerStrategy(...)").
    Called by every entry point before anything is captured, launched or written."""
    from .errors import PlanError

    fn = strategy
    if isinstance(strategy, str) and not strategy.endswith(".json"):
        try:
            fn = get_strategy(strategy)
        except KeyError as e:
            raise PlanError(f"{where}: {e.args[0]}" if where else str(e.args[0])) from None
    own = strategy_options(fn)
    if own is None:
        return
    unknown = [k for k in options if k not in own and k not in COMMON_OPTIONS]
    if not unknown:
        return
    raise PlanError(unknown_options_message(_strategy_label(strategy), unknown, own, where))


def unknown_options_message(label: str, unknown: Iterable[str], own: Iterable[str], where: str = "") -> str:
    own = sorted(own)
    valid = own + sorted(COMMON_OPTIONS)
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else "no valid option is close to it"
        parts.append(f"{label} has no option {name!r} ({hint})")
    takes = f"its options: {', '.join(own)}" if own else "it takes no options of its own"
    return ((where + ": ") if where else "") + "; ".join(parts) + \
        f". {takes[0].upper() + takes[1:]}; every strategy also takes {', '.join(sorted(COMMON_OPTIONS))}"
