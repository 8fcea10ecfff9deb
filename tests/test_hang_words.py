"""Every collective the runtime issues leaves its name in the flight recorder, so a hang inside it is
reported with what it is and what it serves (runtime/watchdog.py): here, the gradient buckets' reductions
of data parallelism, under generated code and under the model's own forward."""
from __future__ import annotations

import re

import pytest
import torch

import models
from nnscaler_plugins.runtime.flight_recorder import OUTSIDE


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def last_wait_after_backward(rank: int, world: int, executor: str) -> tuple[dict, int]:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, _ = models.gpt2_small()
    pm = nns.parallelize(model, _batch(0), plan="dp", executor=executor, cache_dir="/tmp/nns_test_cache")
    loss = pm(**_batch(1)).loss
    loss.backward()  # the buckets' reductions end with the backward: the last one waited for is told
    rec = pm.flight_recorder
    assert rec.done is not None and rec.done[0] == OUTSIDE, rec.done
    return rec.describe_collective(*rec.done), len(pm.grad_reducer.buckets)


@pytest.mark.parametrize("executor", ["captured", "eager"])
def test_a_wait_for_a_gradient_bucket_is_named_by_bucket_and_parameters(workers2, executor):
    for words, buckets in workers2.run(last_wait_after_backward, executor, timeout=180):
        assert re.fullmatch(rf"all-reduce of gradient bucket {buckets} of {buckets} \(\d+ parameters\)",
                            words["collective"]), words
        assert words["op"].startswith("the gradients of ") and "." in words["op"], words


def zero3_waits(rank: int, world: int, executor: str) -> list[dict]:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, _ = models.gpt2_small()
    pm = nns.parallelize(model, _batch(0), plan="zero3", executor=executor, cache_dir="/tmp/nns_test_cache")
    rec = pm.flight_recorder
    seen = []
    enter = rec.enter

    def told(kind, key):  # every wait the runtime tells, in words
        seen.append(rec.describe_collective(kind, key))
        enter(kind, key)

    rec.enter = told
    pm(**_batch(1)).loss.backward()
    return seen


@pytest.mark.parametrize("executor", ["captured", "eager"])
def test_zero3_gathers_and_reduce_scatters_are_named_with_their_parameters(workers2, executor):
    for seen in workers2.run(zero3_waits, executor, timeout=180):
        gathers = [w for w in seen if w["collective"].startswith("ZeRO-3 all-gather of ")]
        reductions = [w for w in seen if w["collective"].startswith("ZeRO-3 reduce-scatter of ")]
        assert gathers and reductions, [w["collective"] for w in seen]
        assert all(w["op"].startswith("the parameters of ") for w in gathers), gathers
        assert all(w["op"].startswith("the gradients of ") for w in reductions), reductions
