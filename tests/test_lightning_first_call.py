"""The Lightning strategy plans the model at its first call inside the user's own training_step:
nothing of the user's runs outside the loop. A training_step that reads the submodule's weights and
logs before calling it, and counts its own calls, runs exactly as often as the loop calls it, and
trains like DDP (losses of every rank and step equal)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

SCRIPT = """
import torch, lightning.pytorch as pl
import nnscaler_plugins.adapters.lightning  # registers "nnscaler"

class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, i):
        assert self.layer[0].weight.shape == (16, 8)  # the submodule's own attributes, before and after planning
        self.log("before", float(i))                 # logging before the model call
        with open(f"calls{self.global_rank}.txt", "a") as f:
            f.write("call\\n")
        loss = self.layer(batch).pow(2).mean()
        with open(f"steps{self.global_rank}.txt", "a") as f:
            f.write(f"STEP {self.global_rank} {self.global_step} {loss.item():.7f}\\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

torch.manual_seed(0)
module, data = LM(), torch.randn(24, 8)
pl.seed_everything(0)
pl.Trainer(strategy=STRATEGY, accelerator="cpu", devices=2, max_steps=3, logger=False,
           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
    module, torch.utils.data.DataLoader(data, batch_size=4))
"""


def _run(tmp_path, strategy: str) -> tuple[dict, dict]:
    (tmp_path / "first_call.py").write_text(SCRIPT.replace("STRATEGY", strategy))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "first_call.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    calls, steps = {}, {}
    for rank in (0, 1):
        calls[rank] = len((tmp_path / f"calls{rank}.txt").read_text().splitlines())
        for line in (tmp_path / f"steps{rank}.txt").read_text().splitlines():
            _, r, i, v = line.split()
            steps[(int(r), int(i))] = float(v)
        (tmp_path / f"calls{rank}.txt").unlink()
        (tmp_path / f"steps{rank}.txt").unlink()
    return calls, steps


def test_training_step_runs_once_per_batch_and_trains_like_ddp(tmp_path):
    calls, ours = _run(tmp_path, '"nnscaler"')
    assert calls == {0: 3, 1: 3}  # no extra call of training_step to find the inputs
    ref_calls, theirs = _run(tmp_path, '"ddp"')
    assert ref_calls == calls and ours.keys() == theirs.keys() and len(ours) == 6
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-6), (k, ours, theirs)
