"""Names the README promises on `nnscaler_plugins`: the three primitives and ParallelModule."""
from __future__ import annotations

import subprocess
import sys

import pytest

import nnscaler_plugins as nns
import models


@pytest.fixture(scope="module")
def mlp_graph():
    model, inputs = models.mlp()
    return nns.capture(model, kwargs=inputs)


def _two_stages(order):
    """A strategy: ops cut in two halves, stage k whole on device k, ordered by `order`."""

    def strategy(builder, **_):
        half = len(builder.ops) // 2
        stages = [builder.ops[:half], builder.ops[half:]]
        for k, ops in enumerate(stages):
            for op in ops:
                builder.replicate(op, devices=[k])
        order(builder, stages)

    strategy.degrees = lambda world_size, **_: (world_size, 1)
    return strategy


def test_op_order_is_exported_and_finds_the_builder_from_the_ops(mlp_graph):
    spellings = {
        "method, by name": lambda b, st: b.op_order([[op.name for op in ops] for ops in st], [[0], [1]],
                                                    schedule="gpipe", micro_batches=2),
        "function": lambda b, st: nns.op_order(st, [[0], [1]], schedule="gpipe", micro_batches=2),
        "function, builder first": lambda b, st: nns.op_order(b, st, [[0], [1]], schedule="gpipe", micro_batches=2),
    }
    plans = {name: nns.plan(mlp_graph, strategy=_two_stages(order), world_size=2).to_json()
             for name, order in spellings.items()}
    first = plans.pop("method, by name")
    assert first["pipeline"] is not None
    for name, p in plans.items():
        assert p == first, name


def test_op_order_of_names_alone_asks_for_the_builder(mlp_graph):
    def names_only(b, st):
        nns.op_order([[op.name for op in ops] for ops in st], [[0], [1]])

    with pytest.raises(TypeError, match="no op handle"):
        nns.plan(mlp_graph, strategy=_two_stages(names_only), world_size=2)


def test_primitives_and_parallel_module_are_public_names():
    assert {"op_trans", "op_assign", "op_order", "ParallelModule"} <= set(nns.__all__)
    from nnscaler_plugins.runtime.parallel_module import ParallelModule

    assert nns.ParallelModule is ParallelModule
    with pytest.raises(AttributeError):
        nns.no_such_name  # noqa: B018


def test_importing_the_package_needs_no_process_group():
    code = ("import torch.distributed as dist, nnscaler_plugins as nns\n"
            "assert not dist.is_initialized()\n"
            "assert nns.ParallelModule.__name__ == 'ParallelModule' and not dist.is_initialized()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
