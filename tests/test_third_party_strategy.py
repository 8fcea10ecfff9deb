"""A strategy written outside the library, with its public names only: a mesh layout and a short
composition of the public passes, registered through the hook a third-party package implements.

The strategy here ("tp_in_batch") is one the library does not ship: inside each replica, the batch
split over a "batch" axis and Megatron tensor parallelism over a "tp" axis (a 2-D unit, as the
search's plans have), replicas over "dp". It is planned by name, its options are checked like a
built-in's, its mesh names its degrees, and it trains exactly like one process.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.hookspecs import hookimpl
from nnscaler_plugins.passes import Parallelization, apply_batch_split, apply_batch_statistics, apply_tp
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plugins import register, unregister


def tp_in_batch(builder: nns.PlanBuilder, *, batch_statistics: Optional[str] = None, **options: Any) -> None:
    """Tensor parallelism over "tp" inside batch pieces over "batch"."""
    par = Parallelization(builder, tp_in_batch.mesh, options)
    apply_tp(par)
    apply_batch_split(par, ("batch",))
    par.place()
    apply_batch_statistics(builder, batch_statistics)


#: replicas x batch pieces x tensor parallelism; tp takes what is left unless given
tp_in_batch.mesh = MeshLayout(("dp", "batch", "tp"), fill=("tp", "dp"))  # type: ignore[attr-defined]
tp_in_batch.options = ("batch_statistics",)  # type: ignore[attr-defined]


class Plugin:
    @hookimpl
    def nnscaler_register_strategies(self) -> dict:
        return {"tp_in_batch": tp_in_batch}


def build() -> tuple[torch.nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                                       embd_pdrop=0.0))
    ids = torch.randint(0, 64, (8, 8))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture()
def plugin():
    p = Plugin()
    register(p, name="test_tp_in_batch")
    yield p
    unregister(p)


def test_planned_by_name_with_its_mesh_and_checked_options(plugin):
    torch.manual_seed(0)
    model, batch = build()
    plan = nns.plan(model, strategy="tp_in_batch", world_size=4, example_inputs=batch, batch=2)
    assert plan.mesh.axes == {"dp": 1, "batch": 2, "tp": 2} and plan.unit_size == 4 and plan.dp == 1
    from nnscaler_plugins.render import plan_label

    assert plan_label(plan).startswith("tp 2 x dp 2")
    attention = [name for name in plan.ops if "scaled_dot_product_attention" in name]
    assert attention and all(len(plan.ops[n].splits) == 2 for n in attention)  # batch x heads
    with pytest.raises(nns.PlanError, match="'batc'.*did you mean 'batch'"):
        nns.plan(model, strategy="tp_in_batch", world_size=4, example_inputs=batch, batc=2)
    with pytest.raises(nns.PlanError, match="batch=3 does not divide the world size 4"):
        nns.plan(model, strategy="tp_in_batch", world_size=4, example_inputs=batch, batch=3)


def run_tp_in_batch(rank: int, world: int) -> list[str]:
    from sgd_check import sgd_equivalence

    return sgd_equivalence(rank, world, build, tp_in_batch, {"batch": 2}, dp=1, what="tp_in_batch")


def test_trains_like_one_process(workers4):
    problems = workers4.run(run_tp_in_batch)
    assert all(not p for p in problems), problems
