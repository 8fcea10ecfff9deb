"""Hooks the framework adapters call (and declare: the core never calls them).

Lightning's and the Hugging Face Trainer's adapters both build example inputs from a real batch
and announce the module they parallelized; these are their hooks. Each adapter plugin declares them
through `nnscaler_add_hookspecs` (whichever registers first), so a third-party plugin implements
them exactly like a core hook.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.hookspecs import hookspec
from nnscaler_plugins.plugins import get_plugin_manager


class AdapterHooks:
    @hookspec(firstresult=True)
    def nnscaler_example_inputs(self, model: Any, batch: Any) -> Optional[Any]:
        """Return the example inputs to capture `model` with, built from one real training batch, or None.

        Framework adapters see batches shaped for the framework's loop (a Hugging Face dict with extra
        keys the forward does not take, a Lightning `(x, y)` tuple) while capture needs exactly what
        the model's forward takes (a dict is keyword arguments, a tuple positional ones, a tensor the
        single argument). The first non-None result wins; the batch itself is used otherwise.
        """

    @hookspec
    def nnscaler_on_parallelized(self, module: Any, plan: Any, framework: str) -> None:
        """Observe a model a framework adapter has just parallelized (`framework`: "lightning", "hf"
        or "deepspeed"): log the plan, attach metrics. Return values are ignored."""


def example_inputs(model: Any, batch: Any) -> Any:
    """What `model`'s forward takes, built from one real batch by the `nnscaler_example_inputs`
    hook; the batch itself when no plugin knows better."""
    found = get_plugin_manager().hook.nnscaler_example_inputs(model=model, batch=batch)
    return batch if found is None else found


def on_parallelized(module: Any, plan: Any, framework: str) -> None:
    get_plugin_manager().hook.nnscaler_on_parallelized(module=module, plan=plan, framework=framework)
