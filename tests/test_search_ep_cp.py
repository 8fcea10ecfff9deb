"""Expert and context parallelism in the search: in its space, priced by the simulator, and the plans
it returns run exactly.

A small mixture-of-experts model (8 stacked experts, top-2) searched on two devices: plans that split the experts with their
tokens (ep) are priced with the experts' work and their all-to-alls, chosen when a memory limit
leaves no room for whole experts on every device, and such a plan, adopted as found, trains like
one process on 2 gloo processes. A small causal model searched with context parallelism: its
frontier holds attention split along the sequence with a named `cp_comm`, which runs exactly too.
Outside a context-parallel search, attention's sequence split is not offered at all (it would be
priced as a free split). Pricing: the experts' all-to-all costs more across nodes than inside one;
ring attention is priced apart from the ordinary op formula and Ulysses is held to head counts.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from sgd_check import sgd_equivalence
from test_context_parallel import causal_lm

import nnscaler_plugins as nns
from nnscaler_plugins.search import group_kernels
from nnscaler_plugins.search.constraints import PipelineStages
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.intraop import IntraSolver
from nnscaler_plugins.search.layouts import Placement
from nnscaler_plugins.search.space import config_of

SPEC = "h100-dgx"
VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 64, 32, 64, 8, 2


class Experts(torch.nn.Module):
    """Stacked expert weights called with (tokens, expert ids, routing weights), as transformers'
    `...Experts` modules are: what `capture/experts.py` recognizes as one op."""

    def __init__(self, experts: int = EXPERTS, hidden: int = HIDDEN, ffn: int = FFN):
        super().__init__()
        self.num_experts = experts
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, ffn) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(experts, ffn, hidden) * 0.1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(ids == e)
            h = torch.relu(x[tok] @ self.w1[e]) @ self.w2[e]
            out = out.index_add(0, tok, h * weights[tok, slot, None])
        return out


class MoE(torch.nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.routers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, EXPERTS, bias=False) for _ in range(layers))
        self.experts = torch.nn.ModuleList(Experts() for _ in range(layers))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids).flatten(0, 1)
        for norm, router, experts in zip(self.norms, self.routers, self.experts):
            y = norm(x)
            w, ids = torch.topk(torch.softmax(router(y), dim=-1), TOP_K, dim=-1)
            x = x + experts(y, ids, w / w.sum(dim=-1, keepdim=True))
        return torch.nn.functional.cross_entropy(self.head(x), labels.flatten())


def moe():
    model = MoE()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    return model, {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def _search(build, **kw):
    torch.manual_seed(0)
    model, batch = build()
    model.eval()  # as the equivalence check runs it
    return nns.search(model, example_inputs=batch, world_size=2, cluster=nns.cluster(SPEC), data_parallel="unit",
                      progress=False, precision="fp32", constraints=[PipelineStages([1])], max_simulated=12, **kw)


@pytest.fixture(scope="module")
def moe_plans():
    return _search(moe)


def _knobs(plan):
    return config_of(plan, plan.graph)


def test_moe_frontier_has_expert_parallel_plans(moe_plans):
    eps = [(p, e) for p, e in zip(moe_plans.plans, moe_plans.estimates) if _knobs(p).ep == 2]
    assert eps, [p.options["summary"] for p in moe_plans.plans]
    plan, est = eps[0]
    assert plan.knobs.experts_as_one_op is True
    # expert state per device is half of what a plan with whole experts holds
    whole = [e for p, e in zip(moe_plans.plans, moe_plans.estimates) if _knobs(p).ep == 1]
    if whole:
        assert est.max_memory_bytes < min(e.max_memory_bytes for e in whole)


def test_memory_limit_without_room_for_whole_experts_picks_ep(moe_plans):
    ep_peak = min(e.max_memory_bytes for p, e in zip(moe_plans.plans, moe_plans.estimates) if _knobs(p).ep == 2)
    plans = _search(moe, memory_limit=ep_peak * 1.001)
    assert _knobs(plans.best).ep == 2, plans.best.options["summary"]


def _run_plan(rank, world, path, name):
    builders = {"moe": moe, "causal": _causal}
    return sgd_equivalence(rank, world, builders[name], path, {}, 1, what=f"searched {name} plan")


def test_adopted_ep_plan_runs_exactly(workers2, moe_plans):
    plan = next(p for p in moe_plans.plans if _knobs(p).ep == 2)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.json")
        plan.save(path)
        problems = workers2.run(_run_plan, path, "moe")
    assert not any(problems), problems


@pytest.fixture(scope="module")
def cp_plans():
    return _search(_causal, context_parallel=True)


def _causal():
    """One long row: the batch cannot be split, the sequence can."""
    return causal_lm(batch=1, seq=32)


def test_cp_frontier_and_adopted_plan_runs_exactly(workers2, cp_plans):
    cps = [p for p in cp_plans.plans if _knobs(p).cp == 2]
    assert cps, [p.options["summary"] for p in cp_plans.plans]
    plan = cps[0]
    assert plan.knobs.cp_comm in group_kernels.CP_MODES
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.json")
        plan.save(path)
        problems = workers2.run(_run_plan, path, "causal")
    assert not any(problems), problems


def _attention_solver(context_parallel: bool, heads: int = 4, kv_heads: int = 2, seq: int = 16):
    model, batch = causal_lm(seq=seq, kv_heads=kv_heads, heads=heads)
    g = nns.capture(model, kwargs=batch)
    cm = CostModel(g, nns.cluster(SPEC, nodes=2))
    solver = IntraSolver(g, cm, Training(dtype="fp32"), (2,), context_parallel=context_parallel)
    attn = next(op for op in g.ops if group_kernels.kind_of(g, op) == "attention")
    return g, cm, solver, attn


def test_sequence_split_of_attention_only_in_context_parallel_search():
    _, _, plain, attn = _attention_solver(False)
    assert not any(l == "s" for c in plain.choices(attn) for l, _ in c.axes)
    _, _, cp, attn = _attention_solver(True)
    mirrored = [c for c in cp.choices(attn) if c.axes == (("s", 2),)]
    assert any(c.blocks == (("s", -2),) for c in mirrored)  # causal: balanced chunks i and 2cp-1-i


def test_attention_priced_per_cp_comm():
    _, cm, _, attn = _attention_solver(True)
    t = Training(dtype="fp32")
    p = Placement((("s", 2),), 1, (("s", -2),), (0, 1))
    ordinary = cm.op_time(attn.name, p, t)
    ring = group_kernels.price(cm, attn, p, t, "ring")
    gather = group_kernels.price(cm, attn, p, t, "allgather")
    ulysses = group_kernels.price(cm, attn, p, t, "ulysses")
    assert ring is not None and gather is not None and ulysses is not None
    for c in (ring, gather, ulysses):  # the exchange is paid on top of the local block's attention
        assert c.time.fwd > ordinary.fwd
    assert len({ring.time.fwd, gather.time.fwd, ulysses.time.fwd}) == 3
    # Ulysses needs the key/value heads to divide: one kv head cannot be swapped over 2 devices
    _, cm1, _, attn1 = _attention_solver(True, kv_heads=1)
    assert group_kernels.price(cm1, attn1, p, t, "ulysses") is None
    assert group_kernels.price(cm1, attn1, p, t, "ring") is not None


def test_expert_all_to_all_priced_on_link_hierarchy():
    from nnscaler_plugins.capture.experts import experts_as_one_op

    torch.manual_seed(0)
    model, batch = moe()
    with experts_as_one_op(model):
        g = nns.capture(model, kwargs=batch)
    spec = nns.cluster(SPEC, nodes=2)
    cm = CostModel(g, spec)
    op = next(o for o in g.ops if group_kernels.kind_of(g, o) == "experts")
    t = Training(dtype="bf16")
    whole = group_kernels.price(cm, op, Placement((), 1, (), (0,)), t)
    split = Placement((("t", 2),), 1, (), (0, 1))
    inside = group_kernels.price(cm, op, split, t)
    across = group_kernels.price(cm, op, split, t, to_global=lambda d: d * spec.devices_per_node)
    assert whole.fwd_comm == 0 and whole.time.flops > 0
    assert inside.time.flops == pytest.approx(whole.time.flops / 2)
    assert 0 < inside.fwd_comm < across.fwd_comm and inside.bwd_comm < across.bwd_comm


def test_simulator_prices_cp_strategy_plans_per_cp_comm():
    """The simulator reads a plan's `cp_comm`: the cp strategy's plans, one per mode, priced apart."""
    model, batch = causal_lm(batch=1, seq=32)
    g = nns.capture(model, kwargs=batch)
    spec = nns.cluster(SPEC)
    times = {}
    for mode in group_kernels.CP_MODES:
        plan = nns.plan(g, strategy="cp", world_size=2, cp_comm=mode)
        times[mode] = nns.simulate(plan, spec).step_time_s
    whole = nns.simulate(nns.plan(g, strategy="dp", world_size=1), spec).step_time_s
    assert len(set(times.values())) == 3, times
    assert all(t > 0 for t in times.values()) and whole > 0


def test_expert_width_split_in_the_search_space():
    """On a 2 x 2 mesh the experts op is offered split along its experts (t) on either axis, along
    each expert's width (f, tensor parallelism inside the experts) on the inner one, and both
    (ep x etp); a width split is priced as 1/etp of the experts' work with no exchange of its own."""
    from nnscaler_plugins.capture.experts import experts_as_one_op

    torch.manual_seed(0)
    model, batch = moe()
    with experts_as_one_op(model):
        g = nns.capture(model, kwargs=batch)
    cm = CostModel(g, nns.cluster(SPEC))
    solver = IntraSolver(g, cm, Training(dtype="fp32"), (2, 2))
    experts = next(op for op in g.ops if group_kernels.kind_of(g, op) == "experts")
    axes = {c.axes: c for c in solver.choices(experts)}
    assert ((None, 2), ("f", 2)) in axes and (("t", 2), ("f", 2)) in axes, list(axes)
    whole = group_kernels.price(cm, experts, axes[((None, 2), (None, 2))].placement(solver.devices), Training("fp32"))
    width = group_kernels.price(cm, experts, axes[((None, 2), ("f", 2))].placement(solver.devices), Training("fp32"))
    assert width.time.flops == pytest.approx(whole.time.flops / 2) and width.fwd_comm == 0.0
