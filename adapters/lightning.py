"""Lightning strategy "nnscaler": `Trainer(strategy="nnscaler")` after `import nnscaler_plugins`.

    import lightning.pytorch as pl            # or: import pytorch_lightning as pl
    import nnscaler_plugins
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    pl.Trainer(strategy="nnscaler", accelerator="cpu", devices=2)              # plan "dp"
    pl.Trainer(strategy=NNScalerStrategy(plan="tp"), devices=4)                # a strategy name + options
    pl.Trainer(strategy=NNScalerStrategy(plan="1f1b", pp=2, micro_batches=4))
    pl.Trainer(strategy=NNScalerStrategy(plan=my_plan_or_file_or_function))

This module is the plugin (entry point `builtin_lightning`): it imports no Lightning itself. When a
Lightning namespace's `strategies` package is imported, the `nnscaler_register_lightning_strategies`
hook registers a strategy class made for that namespace (see `framework_imports`). Both
`lightning.pytorch` and `pytorch_lightning` get their own class, since each Trainer checks
`isinstance` against its own `Strategy`. `NNScalerStrategy` here is the `lightning.pytorch` class
(the `pytorch_lightning` one when only that is installed); `strategy_class(namespace)` gives either.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

from nnscaler_plugins.hookspecs import hookimpl

from .lightning_strategy import NNScalerStrategyMixin

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


@functools.lru_cache(maxsize=None)
def strategy_class(namespace: str) -> type:
    """The NNScalerStrategy class for one Lightning namespace (imports that namespace)."""
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; expected one of {NAMESPACES}")
    parallel = importlib.import_module(f"{namespace}.strategies.parallel").ParallelStrategy
    qualname = "NNScalerStrategy_" + namespace.replace(".", "_")
    cls = type("NNScalerStrategy", (NNScalerStrategyMixin, parallel),
               {"_ns": namespace, "__module__": __name__, "__qualname__": qualname,
                "__doc__": NNScalerStrategyMixin.__doc__})
    return cls


@hookimpl
def nnscaler_add_hookspecs(pluginmanager: Any) -> None:
    from nnscaler_plugins.hookspecs import add_hookspecs_once

    from .hookspecs import AdapterHooks

    add_hookspecs_once(pluginmanager, AdapterHooks)


@hookimpl
def nnscaler_register_lightning_strategies(registry: Any, namespace: str) -> None:
    strategy_class(namespace).register_strategies(registry)


def __getattr__(name: str) -> Any:
    if name == "NNScalerStrategy":
        for ns in NAMESPACES:
            if importlib.util.find_spec(ns.split(".")[0]) is not None:
                return strategy_class(ns)
        raise ImportError("NNScalerStrategy needs Lightning: pip install 'nnscaler-plugins[lightning]'")
    if name.startswith("NNScalerStrategy_"):  # how pickle finds a class (spawned processes)
        ns = {"NNScalerStrategy_" + n.replace(".", "_"): n for n in NAMESPACES}.get(name)
        if ns is not None:
            return strategy_class(ns)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
