"""The strategy before the model is set up, as Lightning uses it (no process is started here):

- `strategy="nnscaler_spawn"`: spawned processes are handed the pickled Trainer, so the strategy, its
  launcher and the capture it runs before launching must pickle (a closure there failed every
  spawned fit of Lightning's own tests);
- a loader set up before the model (Lightning's own tests build stage loaders first) is split by the
  plan's mesh when its degrees are fixed before capture, and refused by name when the plan chooses
  them from the captured model (auto).
"""
from __future__ import annotations

import pickle

import pytest

pytest.importorskip("lightning")


def _trainer(strategy):
    import lightning.pytorch as pl

    import nnscaler_plugins.adapters.lightning  # noqa: F401  registers the strategies

    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_the_spawn_launchers_trainer_pickles():
    trainer = _trainer("nnscaler_spawn")
    launcher = trainer.strategy.launcher
    again = pickle.loads(pickle.dumps(trainer.strategy))
    assert type(again.launcher.launch).__name__ == type(launcher.launch).__name__


def test_a_loader_set_up_before_the_model_is_split_by_the_plans_mesh():
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    assert _trainer("nnscaler").strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert _trainer(NNScalerStrategy(plan="tp")).strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(RuntimeError, match="chooses its data-parallel degree"):
        _trainer(NNScalerStrategy(plan="auto")).strategy.distributed_sampler_kwargs
