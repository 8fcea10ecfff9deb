"""A model that cannot be captured is reported once per job, by rank 0: every rank captures the
same model on the same shapes and fails the same way, so the others stay quiet (the launcher stops
them once rank 0 has failed) and, if nobody does, raise one line pointing at rank 0. The Lightning
strategy captures on the launching process before any other starts (tests/test_lightning.py).
Under plans that keep whole layers on each device such a model runs eagerly instead
(tests/test_eager_executor.py), so the refusal is asked for here with executor="captured"."""
from __future__ import annotations

import torch


class ValueBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # a branch on a value: torch.export cannot capture it
            h = h * 2
        return h.pow(2).mean()


def parallelize_fails(rank: int, world: int) -> tuple[str, str]:
    import time

    import nnscaler_plugins as nns
    from nnscaler_plugins import session as api

    api.QUIET_RANK_WAIT_S, wait = 0.5, api.QUIET_RANK_WAIT_S  # a launcher would stop rank 1 meanwhile
    start = time.monotonic()
    try:
        nns.parallelize(ValueBranch(), torch.randn(4, 8), plan="dp", executor="captured",
                        cache_dir="/tmp/nns_test_cache")
    except nns.CaptureError as e:
        return str(e), f"{time.monotonic() - start:.1f}"
    finally:
        api.QUIET_RANK_WAIT_S = wait
    return "captured", ""


def test_rank_zero_reports_the_capture_error_the_others_one_line(workers2):
    (first, _), (other, waited) = workers2.run(parallelize_fails)
    assert "ValueBranch" in first and "test_capture_errors_once.py:19" in first and "if h.sum() > 0" in first, first
    assert len(other.splitlines()) == 1 and other.startswith("rank 1: ") and "rank 0 reports" in other, other
    assert float(waited) >= 0.5
