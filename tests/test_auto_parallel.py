"""strategy="auto" parallelizes, and its label says how.

On a cluster whose collectives are slow next to the ops (a CPU: per-op launch costs that do not
shrink with the batch, an all-reduce paying the link's latency) the cost model prices "every
device runs every op" fastest, and `auto` used to hand that plan back labelled "dp 2": both
processes computed the whole batch and no collective ran. The clusters here make that case certain
(a link a thousand times slower than the CPU preset's) as well as the preset itself, on three
model families (GPT-2, Llama, a ViT) at world 2 and 4: the chosen plan must split the heavy ops
over the whole unit (each device a share of them: data or tensor parallelism), and its label must
name degrees that multiply to the world and that the placements carry out.
"""
from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

import models

import nnscaler_plugins as nns
from nnscaler_plugins.plan.label import copies_every_op, plan_label
from nnscaler_plugins.search import SearchError

HEAVY = ("aten.linear.", "aten.matmul.", "aten.mm.", "aten.bmm.", "aten.addmm.", "aten.conv", "aten.embedding.")


def _cluster(world: int, slow: bool):
    spec = nns.cluster("local-cpu", devices=world, measure=False)
    if slow:  # collectives priced far above any op: copies look fastest to the cost model
        link = dataclasses.replace(spec.intra_node, bandwidth=spec.intra_node.bandwidth / 1000,
                                   latency=spec.intra_node.latency * 1000)
        spec = dataclasses.replace(spec, intra_node=link, inter_node=link)
    return spec


def _check_parallel(plan, graph, world: int) -> str:
    label = plan_label(plan)
    assert not copies_every_op(plan) and "copied" not in label, label
    heavy = [op.name for op in graph.ops if op.op_name.startswith(HEAVY)]
    assert heavy
    pieces = {name: _pieces(plan.ops[name]) for name in heavy}
    whole_unit = [n for n, k in pieces.items() if k == plan.unit_size]
    # every device computes its own share of (nearly) every heavy op: no device repeats another's work
    assert len(whole_unit) >= 0.75 * len(heavy), (label, pieces)
    degrees = {name: int(n) for name, n in re.findall(r"\b(dp|tp|cp|pp) (\d+)", label)}
    total = 1
    for n in degrees.values():
        total *= n
    assert total == world, (label, degrees)
    if degrees.get("dp", 1) > 1 and plan.dp == 1:  # the batch split inside the unit: the loss reads split rows
        loss = next(op for op in reversed(graph.ops) if op.op_name.startswith(("aten.cross_entropy", "aten.nll_loss")))
        assert _pieces(plan.ops[loss.name]) >= degrees["dp"], (label, plan.ops[loss.name])
    return label


def _pieces(p) -> int:
    out = 1
    for _, n in p.splits:
        out *= n
    return out


@pytest.mark.parametrize("slow", [True, False], ids=["slow-links", "cpu-preset"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["gpt2_small", "llama_small", "vit_small"])
def test_auto_divides_the_work(name, world, slow):
    torch.manual_seed(0)
    model, inputs = getattr(models, name)()
    graph = nns.capture(model, kwargs=inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no copying plan, so no warning that explains one
        warnings.filterwarnings("ignore", message=".*loss_type.*")
        plan = nns.plan(graph, strategy="auto", world_size=world, cluster=_cluster(world, slow))
    assert "why_copies" not in plan.options
    _check_parallel(plan, graph, world)


class _Odd(torch.nn.Module):
    """Nothing splits two ways: three rows, widths 3 and 5."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def test_a_plan_that_copies_every_op_says_why():
    torch.manual_seed(0)
    graph = nns.capture(_Odd(), args=(torch.randn(3, 3),))
    with pytest.warns(UserWarning, match=r"batch of 3 rows does not split 2 ways"):
        plan = nns.plan(graph, strategy="auto", world_size=2, cluster=_cluster(2, False))
    assert copies_every_op(plan)
    assert "batch of 3 rows" in plan.options["why_copies"]
    label = plan_label(plan)
    assert label.startswith("every op copied on each of the 2 devices"), label
    assert "dp 2" not in label and "tp 2" not in label


def test_memory_that_forbids_data_parallelism_is_named():
    torch.manual_seed(0)
    model, inputs = models.gpt2_small()
    graph = nns.capture(model, kwargs=inputs)
    with pytest.raises(SearchError, match=r"peak memory per device <= 0\.00 GiB.*data parallelism over 2 devices "
                                          r"needs \d+\.\d+ GiB per device"):
        nns.plan(graph, strategy="auto", world_size=2, cluster=_cluster(2, False), memory_limit=1000,
                 constraints=[nns.search.PipelineStages([1])])
