"""A pytest plugin that runs Lightning's own tests with the DDP strategies swapped for this library's.

`-p nns_shim` (this folder on PYTHONPATH) wraps `Trainer.__init__`: a `strategy=` of "ddp",
"ddp_spawn", "ddp_fork", "ddp_notebook" or the find-unused-parameters variants becomes "nnscaler"
or "nnscaler_spawn" (the default plan, dp). Each swap is written to $NNS_SHIM_LOG (the current
test's id and the strategy replaced), so a count is over the tests the swap reached. NNS_SHIM=0
runs the same tests on stock Lightning. Strategies given as objects (`DDPStrategy(...)`) are left
alone: tests of DDP's own internals do not count.
"""
from __future__ import annotations

import functools
import os
from typing import Any

SWAP = {"ddp": "nnscaler", "ddp_spawn": "nnscaler_spawn", "ddp_fork": "nnscaler", "ddp_notebook": "nnscaler",
        "ddp_find_unused_parameters_true": "nnscaler", "ddp_spawn_find_unused_parameters_true": "nnscaler_spawn"}


def pytest_configure(config: Any) -> None:
    if os.environ.get("NNS_SHIM", "1") != "1":
        return
    import lightning.pytorch as pl

    import nnscaler_plugins.adapters.lightning  # noqa: F401  registers "nnscaler" and "nnscaler_spawn"

    original = pl.Trainer.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        strategy = kwargs.get("strategy")
        if isinstance(strategy, str) and strategy in SWAP:
            kwargs["strategy"] = SWAP[strategy]
            log = os.environ.get("NNS_SHIM_LOG")
            if log:
                test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
                with open(log, "a") as f:
                    f.write(f"{test}\t{strategy}\n")
        original(self, *args, **kwargs)

    pl.Trainer.__init__ = init
