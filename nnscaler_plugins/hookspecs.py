"""The contract between the core and its plugins: the hooks the core calls.

Built-in strategies and adapters implement these exactly like a third-party package would (the
plugin manager registers them by module name; the core's code never imports them). Hooks that only
adapters call are declared by the adapters (`adapters/hookspecs.py`, `adapters/deepspeed_hooks.py`)
through `nnscaler_add_hookspecs`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pluggy

hookspec = pluggy.HookspecMarker("nnscaler_plugins")
hookimpl = pluggy.HookimplMarker("nnscaler_plugins")


@hookspec(historic=True)
def nnscaler_add_hookspecs(pluginmanager: Any) -> None:
    """Declare hooks of your own: call `pluginmanager.add_hookspecs(module_or_class)`. Called once for
    every plugin, when it is registered (as pytest's `pytest_addhooks`), so a plugin that calls its
    own hooks declares them itself; `add_hookspecs_once` avoids declaring a hook twice."""


@hookspec
def nnscaler_register_strategies() -> dict[str, Callable]:
    """Return {name: strategy}. A strategy is `fn(builder, **options)` that applies op_trans and
    op_assign to every op of `builder.ops` for one unit of `builder.unit_size` devices; an optional
    `fn.degrees(world_size, **options) -> (unit_size, dp)` says how it splits the world, and an
    optional `fn.options` (an iterable of names) declares the options it takes, so that every entry
    point refuses a misspelt one before anything starts. Without `options`, the function's keyword
    parameters (and its `degrees`') are its options; a function taking `**options` with no
    declaration is not checked. The training knobs every strategy takes (`plan_source.COMMON_OPTIONS`:
    zero, precision, micro_batches, micro_batch_size, cluster, constraints) need no declaring.

    Names must be unique across plugins; a clash raises at first use with both plugin names.
    """


@hookspec
def nnscaler_register_op_rules() -> dict[Any, Callable]:
    """Return {aten overload or its string name: rule}. A rule is `fn(call: OpCall) -> Signature | None`.

    Rules from plugins override built-in rules for the same overload, so a plugin can teach the
    planner how its custom op splits (see CONTRIBUTING.md, "Adding an op rule").
    """


@hookspec
def nnscaler_adapt_model_for_capture(model: Any, kwargs: dict) -> Optional[Any]:
    """Return a context manager to enter around `torch.export`, or None.

    Used to switch off features that cannot be captured (KV caches) only for the capture and put
    them back afterwards. May also add keyword arguments to `kwargs` in place.
    """


@hookspec(firstresult=True)
def nnscaler_choose_backend(device_type: str) -> Optional[str]:
    """Return the torch.distributed backend for a device type ("cuda" -> "nccl", "cpu" -> "gloo")."""


@hookspec
def nnscaler_search_options(options: dict) -> None:
    """See and alter a plan search's options before it runs, in place: `options["constraints"]` (a list
    a plugin may append to), "world_size", "cluster", "global_batch_size", "memory_limit"."""


@hookspec
def nnscaler_search_result(result: Any, options: dict) -> None:
    """See a plan search's result (a ParetoSet, fastest plan first) after it ran; a plugin may reorder
    or drop plans in place (e.g. to prefer plans its runtime supports)."""


@hookspec
def nnscaler_register_lightning_strategies(registry: Any, namespace: str) -> None:
    """Register strategy names into a Lightning `StrategyRegistry` (`registry.register(name, cls, ...)`).

    Called once per Lightning namespace ("lightning.pytorch" or "pytorch_lightning") the first time
    that namespace's `strategies` module is imported after `import nnscaler_plugins` (or at once when
    it already was), so `Trainer(strategy="nnscaler")` works without importing Lightning eagerly.
    The two namespaces are separate copies of Lightning: a class must subclass the `Strategy` of the
    `namespace` it registers into.
    """


def add_hookspecs_once(pluginmanager: Any, specs: Any) -> None:
    """`pluginmanager.add_hookspecs(specs)` unless its hooks are declared already (two adapters may
    declare the same shared hooks)."""
    names = [n for n in dir(specs) if n.startswith("nnscaler_")]
    if not all(getattr(getattr(pluginmanager.hook, n, None), "spec", None) is not None for n in names):
        pluginmanager.add_hookspecs(specs)
