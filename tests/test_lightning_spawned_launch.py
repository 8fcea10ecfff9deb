"""`strategy="nnscaler_spawn"`: spawned processes are handed the pickled Trainer, so the strategy, its
launcher and the capture it runs before launching must pickle (a closure there failed every spawned
fit of Lightning's own tests). No process is started here."""
from __future__ import annotations

import pickle

import pytest

pytest.importorskip("lightning")


def test_the_spawn_launchers_trainer_pickles():
    import lightning.pytorch as pl

    import nnscaler_plugins.adapters.lightning  # noqa: F401  registers the strategies

    trainer = pl.Trainer(strategy="nnscaler_spawn", accelerator="cpu", devices=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    launcher = trainer.strategy.launcher
    assert launcher is not None and launcher.is_interactive_compatible is not None
    again = pickle.loads(pickle.dumps(trainer.strategy))
    assert type(again.launcher.launch).__name__ == type(launcher.launch).__name__
