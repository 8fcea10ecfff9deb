"""The whole contract between the core and its plugins.

Built-in strategies and adapters implement these exactly like a third-party package would: they are
found through the `nnscaler_plugins` entry-point group and never imported by the core.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pluggy

hookspec = pluggy.HookspecMarker("nnscaler_plugins")
hookimpl = pluggy.HookimplMarker("nnscaler_plugins")


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


@hookspec(firstresult=True)
def nnscaler_translate_deepspeed_config(config: dict) -> Optional[dict]:
    """Translate a DeepSpeed JSON config (already loaded into a dict) into this project's settings.

    The DeepSpeed drop-in engine calls this once per `initialize`, so a plugin can support keys the
    built-in translation refuses (or refuse keys it accepts). Return a dict with the translated
    settings, or None to leave the config to the next implementation; the first non-None result
    wins. Keys that cannot be honoured must be refused or warned about by name, never dropped.
    """


@hookspec(firstresult=True)
def nnscaler_example_inputs(model: Any, batch: Any) -> Optional[Any]:
    """Return the example inputs to capture `model` with, built from one real training batch, or None.

    Framework adapters see batches shaped for the framework's loop (a Hugging Face dict with extra
    keys the forward does not take, a Lightning `(x, y)` tuple) while capture needs exactly what the
    model's forward takes (DESIGN section 5: dict = keyword arguments, tuple = positional, tensor =
    the single argument). The first non-None result wins; the core falls back to the batch itself.
    """


@hookspec
def nnscaler_register_lightning_strategies(registry: Any, namespace: str) -> None:
    """Register strategy names into a Lightning `StrategyRegistry` (`registry.register(name, cls, ...)`).

    Called once per Lightning namespace ("lightning.pytorch" or "pytorch_lightning") the first time
    that namespace's `strategies` module is imported after `import nnscaler_plugins` (or at once when
    it already was), so `Trainer(strategy="nnscaler")` works without importing Lightning eagerly.
    The two namespaces are separate copies of Lightning: a class must subclass the `Strategy` of the
    `namespace` it registers into.
    """


@hookspec
def nnscaler_on_parallelized(module: Any, plan: Any, framework: str) -> None:
    """Observe a model a framework adapter has just parallelized (`framework`: "lightning", "hf",
    "deepspeed" or "core"): log the plan, attach metrics. Return values are ignored."""
