"""Nothing the library does before training moves a random stream the user's code draws from: capture
(torch.export itself advances torch's generator while tracing) and the adapters' read of an example
batch through a collator that draws (a masking collator) leave torch's, Python's and NumPy's global
generators as they were, so the first real step draws, and masks, what the plain loop does."""
from __future__ import annotations

import random

import numpy as np
import torch


def _states() -> tuple:
    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


class _DrawsInPython(torch.nn.Module):
    """A forward drawing from Python's and NumPy's generators (a stochastic-depth coin flipped with
    `random.random()`, a jitter from NumPy): tracing runs it, and so draws."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = 1.0 + 0.0 * random.random() + 0.0 * float(np.random.rand())
        return (self.fc(x) * scale).pow(2).mean()


class _Drops(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.fc(x), 0.5).pow(2).mean()


def test_capture_moves_no_random_stream():
    import nnscaler_plugins as nns

    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    for model in (_Drops(), _DrawsInPython()):
        x = torch.randn(4, 8)
        before = _states()
        nns.capture(model, (x,))
        assert _same(before, _states()), type(model).__name__


def test_the_hf_adapters_example_batch_is_read_without_moving_a_stream(tmp_path):
    """A collator that draws from all three generators, as DataCollatorForLanguageModeling draws from
    torch's: reading the example through it leaves them as they were."""
    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.full((8,), float(i))}

    def drawing_collator(rows):
        noise = torch.rand(len(rows), 8) + random.random() + float(np.random.rand())
        return {"x": torch.stack([r["x"] for r in rows]) + noise}

    trainer = NNScalerTrainer(model=_Drops(), args=NNScalerTrainingArguments(
        output_dir=str(tmp_path), plan="dp", use_cpu=True, per_device_train_batch_size=2, report_to=[]),
        train_dataset=Rows(), data_collator=drawing_collator)
    before = _states()
    batch = trainer._nns_first_batch()
    assert batch["x"].shape == (2, 8)
    assert _same(before, _states())


def test_run_mlm_masks_the_tokens_the_plain_trainer_masks_from_step_one(tmp_path):
    """run_mlm.py's collator under tp on 2 processes (one replica: both ranks take the same batches): the
    losses of every step are the plain Trainer's on one process with that batch (before, reading the
    example through the collator moved torch's generator, and step 1 masked other tokens)."""
    import pytest

    from torchrun_jobs import run_job

    plain = run_job(tmp_path, "hf_mlm_job.py", "plain", nproc=1)
    ours = run_job(tmp_path, "hf_mlm_job.py", "tp")
    assert len(plain["losses"]) == 3
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-4), (plain, ours)
