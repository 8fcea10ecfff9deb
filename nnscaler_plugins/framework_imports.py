"""Run a plugin hook when a framework module is first imported.

`import nnscaler_plugins` must neither import Lightning (seconds, and it may not be installed) nor
miss it: `Trainer(strategy="nnscaler")` looks the name up in Lightning's own registry. So this module
puts a finder on `sys.meta_path` that notices when a watched module (a Lightning namespace's
`strategies` package) finishes executing and then calls the `nnscaler_register_lightning_strategies`
hook with that module's registry. A module already imported is handled at once.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Any, Optional

# module name -> the Lightning namespace it belongs to
LIGHTNING_STRATEGY_MODULES = {
    "lightning.pytorch.strategies": "lightning.pytorch",
    "pytorch_lightning.strategies": "pytorch_lightning",
}

_done: set[str] = set()
_lock = threading.RLock()


def _register_lightning(module: types.ModuleType, namespace: str) -> None:
    from nnscaler_plugins.plugins import get_plugin_manager

    registry = getattr(module, "StrategyRegistry", None)
    if registry is None:
        return
    get_plugin_manager().hook.nnscaler_register_lightning_strategies(registry=registry, namespace=namespace)


def _on_imported(name: str, module: types.ModuleType) -> None:
    with _lock:
        if name in _done:
            return
        _done.add(name)
    _register_lightning(module, LIGHTNING_STRATEGY_MODULES[name])


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader and reports the module once it has executed."""

    def __init__(self, loader: Any, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _on_imported(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, attr)


class _Watcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in LIGHTNING_STRATEGY_MODULES or fullname in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader, fullname)
                return spec
        return None


def watch() -> None:
    """Install the watcher (idempotent) and handle watched modules that are already imported."""
    with _lock:
        if not any(isinstance(f, _Watcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _Watcher())
    for name in LIGHTNING_STRATEGY_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "StrategyRegistry", None) is not None:
            _on_imported(name, module)
