"""The library's store keys carry the launcher's restart attempt: a restarted job that still shares the
killed attempt's store (torchrun's default) never reads what the killed processes wrote."""
from __future__ import annotations

import torch.distributed as dist

from nnscaler_plugins.runtime.job_store import key


def test_a_restarted_attempt_does_not_see_the_keys_of_the_killed_one(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    store.set(key("heartbeat", 1), "step 7 of the killed attempt")
    assert store.check([key("heartbeat", 1)])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not store.check([key("heartbeat", 1)])  # the new attempt's key is its own
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert key("heartbeat", 1) == "nnscaler_plugins/attempt0/heartbeat/1"  # outside torchrun: attempt 0
