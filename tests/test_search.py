"""The search: against brute force on small cases, deterministic, constrained, and saying why not."""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math

import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins.cli import main as cli
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.search import (
    HFTensorParallelPlan,
    MaxTensorParallel,
    MemoryLimit,
    NotSplit,
    PipelineStages,
    RecomputeModes,
    Replicated,
    SameLayerConfig,
    Schedules,
    SearchError,
    ZeroStages,
    check,
)
from nnscaler_plugins.search.costmodel import CostModel, Training
from nnscaler_plugins.search.intraop import IntraSolver
from nnscaler_plugins.search.pareto import frontier, hypervolume
from nnscaler_plugins.search.progress import Progress
from nnscaler_plugins.search.solver import Candidate, Search
from nnscaler_plugins.search.space import RECOMPUTE, Config, divisors

GiB = 1024 ** 3


def tiny_gpt(layers=4, h=256, heads=4, seq=256, vocab=2048, batch=1):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=h, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def gpt():
    model, inputs = tiny_gpt()
    return nns.capture(model, kwargs=inputs)


# -- brute force --------------------------------------------------------------------------------------------
def brute_force(graph, world, spec, G, constraints):
    """Every configuration of the space the search spans, every stage cut, simulated in full."""
    s = Search({1: graph}, world, spec, constraints, G, None, False)
    cm = CostModel(graph, spec)
    points = []
    for g in s.group_sizes():
        solver = IntraSolver(graph, cm, Training(spec.dtype), (g,), s.constraints, None, 1, max(1, world // g))
        for intra in solver.solve():
            L = len(intra.layer_segments)
            for pp in divisors(world // g):
                if pp > L:
                    continue
                dp = world // (g * pp)
                m = G // dp if G % dp == 0 else None
                if m is None:
                    continue
                scheds = [("none", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1)] + \
                    [("interleaved", v) for v in (2, 3, 4) if L >= pp * v and m % pp == 0]
                for schedule, v in scheds:
                    S = pp * v
                    cuts = [list(c) for c in itertools.combinations(range(1, L), S - 1)]
                    for cut in cuts:
                        bounds = [0] + cut + [L]
                        for zero in (0, 1, 2, 3):
                            if zero == 3 and schedule == "zero-bubble":  # refused by the runtime
                                continue
                            for rec in RECOMPUTE:
                                cfg = Config(g, (g,), pp, dp, 1, m, schedule, v, zero, rec, intra.tp)
                                if not all(c.allows(cfg) for c in s.constraints):
                                    continue
                                plan = s.materialize(Candidate(cfg, intra, bounds, 0.0, 0.0, graph))
                                est = nns.simulate(plan, spec, cost_model=cm)
                                if est.max_memory_bytes <= spec.memory_bytes:
                                    points.append((est.step_time_s, est.max_memory_bytes))
    return points


@pytest.mark.parametrize("world", [8, 16])
def test_frontier_covers_brute_force(gpt, world):
    spec = nns.cluster("a100-dgx", nodes=world // 8)
    constraints = [ZeroStages([0, 3]), RecomputeModes(["none", "full"])] + \
        ([PipelineStages([1, 2])] if world == 16 else [])
    brute = brute_force(gpt, world, spec, 16, constraints)
    found = nns.search(gpt, world_size=world, cluster=spec, global_batch_size=16, constraints=constraints,
                       progress=False)
    ref = (max(t for t, _ in brute) * 1.05, max(m for _, m in brute) * 1.05)
    best = [brute[i] for i in frontier(brute)]
    covered = hypervolume(found.points(), ref) / hypervolume(best, ref)
    assert covered >= 0.99, (covered, best, found.points())
    assert found.estimates[0].step_time_s <= min(t for t, _ in brute) * 1.01


def test_intra_op_search_matches_exhaustive_anchor_choices():
    """Every combination of the anchors' choices (the other ops following greedily) vs the solver."""
    import models
    model, inputs = models.mlp()
    graph = nns.capture(model, kwargs=inputs)
    spec = nns.cluster("a100-dgx")
    cm = CostModel(graph, spec)
    solver = IntraSolver(graph, cm, Training("bf16"), (4,))
    moves = [solver._anchor_moves(graph.op(a)) for a in solver.anchors]
    points = []
    for combo in itertools.product(*moves):
        walked = solver.walk(dict(zip(solver.anchors, combo)))
        if walked is not None:
            r = solver.evaluate(walked)
            points.append((r.time, r.memory))
    found = [(r.time, r.memory) for r in solver.solve()]
    assert min(t for t, _ in found) <= min(t for t, _ in points) * (1 + 1e-9)
    ref = (max(t for t, _ in points) * 1.05, max(m for _, m in points) * 1.05)
    assert hypervolume(found, ref) >= 0.99 * hypervolume([points[i] for i in frontier(points)], ref) or \
        len(found) >= 1 and min(found)[0] <= min(points)[0]


def test_deterministic(gpt):
    spec = nns.cluster("a100-dgx")
    a = nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, progress=False)
    b = nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, progress=False)
    assert [p.to_json() for p in a] == [p.to_json() for p in b]
    assert all(p.estimate["step_time_s"] > 0 for p in a)
    assert [e.step_time_s for e in a.estimates] == sorted(e.step_time_s for e in a.estimates)


def test_constraints_prune_and_validate(gpt):
    spec = nns.cluster("a100-dgx", nodes=2)
    cons = [MaxTensorParallel(2), PipelineStages([1, 2]), Schedules(["gpipe"]), ZeroStages([0, 1]),
            Replicated("lm_head"), NotSplit("transformer.wte", "batch"), SameLayerConfig(), MemoryLimit("20GiB")]
    plans = nns.search(gpt, world_size=16, cluster=spec, global_batch_size=32, constraints=cons, progress=False)
    for plan in plans:
        check(plan, gpt, cons, cluster=spec)
        assert plan.mesh.dense_degrees()["tp"] <= 2 and plan.zero in (0, 1)
        assert plan.pipeline is None or (plan.pipeline.num_ranks == 2 and plan.pipeline.schedule == "gpipe")
        lm_head = next(op for op in gpt.ops if op.module_path == "lm_head")
        assert not plan.ops[lm_head.name].splits
    tp_plan = nns.plan(gpt, strategy="tp", world_size=8)
    with pytest.raises(PlanError, match="tensor-parallel degree <= 2"):
        check(tp_plan, gpt, [MaxTensorParallel(2)])
    with pytest.raises(PlanError, match="lm_head replicated"):
        check(tp_plan, gpt, [Replicated("lm_head")])
    with pytest.raises(PlanError, match="peak memory per device <= 0.00 GiB"):
        check(tp_plan, gpt, [MemoryLimit(1000)], cluster=spec)


def test_messages_name_the_binding_constraint(gpt):
    spec = nns.cluster("a100-dgx")
    with pytest.raises(SearchError, match=r"binding: 'pipeline stage count in \[3\]'"):
        nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, constraints=[PipelineStages([3])],
                   progress=False)
    with pytest.raises(SearchError, match=r"binding constraint: peak memory per device <= 0.00 GiB.*smallest peak"):
        nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, memory_limit=1e5, progress=False)
    with pytest.raises(SearchError, match=r"has 8 devices.*world_size is 64"):
        nns.search(gpt, world_size=64, cluster=spec, progress=False)


def test_transformers_tp_plan_as_prior_and_constraint():
    import models
    model, inputs = models.llama_small()
    graph = nns.capture(model, kwargs=inputs)
    prior = HFTensorParallelPlan.of(model)
    spec = nns.cluster("a100-dgx")
    cm = CostModel(graph, spec)
    solver = IntraSolver(graph, cm, Training("bf16"), (4,), [prior], prior)
    assert "transformers tp plan" in [name for name, _ in solver.seeds()]
    required = HFTensorParallelPlan.of(model, require=True)
    plans = nns.search(graph, world_size=4, cluster=spec, constraints=[required, PipelineStages([1])],
                       max_group=4, progress=False)
    for plan in plans:
        check(plan, graph, [required])
    q = next(op for op in graph.ops if op.module_path.endswith("self_attn.q_proj"))
    bad = nns.plan(graph, strategy="tp", world_size=4)
    bad.ops[q.name].splits = [("k", 4)]
    with pytest.raises(PlanError, match="should be column-parallel"):
        check(bad, graph, [required])


def test_model_with_micro_batch_sizes():
    from nnscaler_plugins.search import MicroBatchSize
    model, inputs = tiny_gpt(layers=2, batch=4)
    plans = nns.search(model, example_inputs=inputs, world_size=4, cluster=nns.cluster("a100-dgx"),
                       global_batch_size=16, constraints=[MicroBatchSize([2, 4]), PipelineStages([1])], progress=False)
    assert {p.options["micro_batch_size"] for p in plans} <= {2, 4}
    assert all(p.graph is not None and p.options["global_batch_size"] == 16 for p in plans)


def test_progress_bar_on_long_searches():
    out = io.StringIO()
    bar = Progress("nnscaler search", 4, stream=out, delay_s=0.0)
    bar.set("intra-op choices", 4)
    for _ in range(4):
        bar.step()
    bar.close("done")
    text = out.getvalue()
    assert "intra-op choices" in text and "100%" in text and "done in" in text
    quiet = io.StringIO()
    Progress("x", 2, stream=quiet, delay_s=60).step()
    assert quiet.getvalue() == ""  # searches under the delay print nothing


# -- the command --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    from transformers import GPT2Config
    d = tmp_path_factory.mktemp("model")
    GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=128).save_pretrained(d)
    return str(d / "config.json")


def test_cli_search_explain_simulate_show_render(config_file, tmp_path, capsys):
    out = tmp_path / "plans"
    assert cli(["search", config_file, "-n", "8", "--cluster", "a100-dgx", "--global-batch", "16", "--seq", "128",
                "-c", "max-tp", "-c", "zero=0,1", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "Pareto frontier" in text and (out / "plan_0.json").exists() and (out / "pareto.svg").exists()
    plan0 = str(out / "plan_0.json")
    assert cli(["explain", plan0]) == 0 and "step" in capsys.readouterr().out
    assert cli(["simulate", plan0, "--model", config_file, "--cluster", "a100-dgx", "--timeline",
                str(tmp_path / "t.svg")]) == 0
    assert "peak memory" in capsys.readouterr().out and (tmp_path / "t.svg").read_text().startswith("<svg")
    assert cli(["show", plan0, "--model", config_file, "--rank", "0"]) == 0
    assert "def forward" in capsys.readouterr().out
    assert cli(["render", plan0, "--model", config_file, "--cluster", "a100-dgx", "--out", str(tmp_path / "pics"),
                "--format", "html"]) == 0
    names = sorted(p.name for p in (tmp_path / "pics").iterdir())
    assert names == ["pareto.html", "plan_0_devices.html", "plan_0_timeline.html"]


@pytest.mark.parametrize("args,message", [
    (["--cluster", "dgx-z"], "unknown cluster 'dgx-z'"),
    (["--cluster", "a100-dgx", "-c", "pp=3"], "binding: 'pipeline stage count in [3]'"),
    (["--cluster", "a100-dgx", "--memory-limit", "1MiB"], "binding constraint: peak memory per device <= 0.00 GiB"),
    (["--cluster", "a100-dgx", "-c", "pp=two"], "constraint 'pp=two'"),
    (["--cluster", "a100-dgx", "-c", "fast"], "unknown constraint 'fast'"),
])
def test_cli_bad_input_names_the_problem(config_file, capsys, args, message):
    code = cli(["search", config_file, "-n", "8", "--global-batch", "16", "--seq", "128", "--no-progress"] + args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_render_timeline_draws_every_task(gpt):
    from nnscaler_plugins.plan.schedules import PipelineShape, build
    from nnscaler_plugins.plan.timeline import replay
    from nnscaler_plugins.render import render_timeline

    shape = PipelineShape(4, 4, 8)
    tl = replay(build("1f1b", shape), shape, lambda r, t: 1.0 if t.kind == "F" else 2.0)
    svg = render_timeline(tl, None, title="1f1b")
    assert svg.count("<rect") == 4 + 64 + 4  # row bands, one box per task, legend
    assert "bubble" in svg


def test_search_hooks_see_and_alter_options_and_result(gpt):
    from nnscaler_plugins.hookspecs import hookimpl
    from nnscaler_plugins.plugins import register, unregister

    class Plugin:
        seen = []

        @hookimpl
        def nnscaler_search_options(self, options):
            options["constraints"].append(PipelineStages([1]))

        @hookimpl
        def nnscaler_search_result(self, result, options):
            self.seen.append(len(result.plans))

    plugin = Plugin()
    register(plugin, name="search-test-plugin")
    try:
        plans = nns.search(gpt, world_size=8, cluster=nns.cluster("a100-dgx"), global_batch_size=16, progress=False)
    finally:
        unregister(plugin)
    assert all(p.pipeline is None for p in plans) and plugin.seen == [len(plans)]


# -- what is priced is what runs ----------------------------------------------------------------------------
def _recompute_groups(plan) -> dict:
    return {name: p.recompute for name, p in plan.ops.items() if p.recompute is not None}


def _check_priced_is_run(plan, graph, spec):
    """The estimate's pricing inputs against the plan fields the runtime reads, and the plan
    re-priced from those fields gives its estimate again."""
    from nnscaler_plugins.plan.layers import layer_groups
    from nnscaler_plugins.search.opcost import OpCosts
    from nnscaler_plugins.search.simulator import training_of

    priced = plan.estimate["details"]["training"]
    assert priced["dtype"] == plan.precision  # the runtime's compute precision
    assert priced["zero"] == plan.zero  # the runtime's ZeRO stage
    assert plan.zero == 0 or plan.dp > 1  # ZeRO shards across replicas: none is priced where none runs
    assert training_of(plan, spec).to_json() == priced
    groups = _recompute_groups(plan)  # what the generated code runs under checkpoint
    layers = layer_groups(graph).layers
    assert priced["recompute"] == plan.knobs.recompute
    if priced["recompute"] == "none":
        assert not groups
    elif priced["recompute"] == "full":
        assert set(groups) == {op.name for layer in layers for op in layer} and len(set(groups.values())) == len(layers)
    else:
        core = {n for n, c in OpCosts.of(graph).ops.items() if c.core}
        assert groups and set(groups) <= core
    assert priced["sequence_parallel"] == plan.knobs.sequence_parallel
    if priced["sequence_parallel"]:  # the sequence splits are in the plan, so lowering emits them
        assert _sequence_split_ops(plan, graph)
    again = nns.simulate(plan, spec, graph)
    assert again.step_time_s == pytest.approx(plan.estimate["step_time_s"], rel=1e-9)
    assert again.max_memory_bytes == pytest.approx(plan.estimate["max_memory_bytes"], rel=1e-9)


def _sequence_split_ops(plan, graph) -> list[str]:
    from nnscaler_plugins.plan.layers import layer_groups
    from nnscaler_plugins.rules import signature_for
    from nnscaler_plugins.search.dims import SEQUENCE, tag_labels

    tags = tag_labels(graph, {op.name: signature_for(graph, op) for op in graph.ops})
    layer_ops = {op.name for layer in layer_groups(graph).layers for op in layer}
    return [n for n in layer_ops if any(tags[n].get(l) == SEQUENCE for l, _ in plan.ops[n].splits)]


def test_plans_carry_the_precision_zero_and_recompute_they_were_priced_with(gpt):
    spec = nns.cluster("a100-dgx")
    plans = nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, progress=False, max_simulated=12)
    assert {p.precision for p in plans} == {"bf16"}  # the cluster's training dtype, now the plans' own
    assert {p.zero for p in plans} != {0} or any(p.knobs.recompute != "none" for p in plans)
    for plan in plans:
        _check_priced_is_run(plan, gpt, spec)
    fp32 = nns.search(gpt, world_size=8, cluster=spec, global_batch_size=16, progress=False, precision="fp32")
    for plan in fp32:
        assert plan.precision == "fp32"
        _check_priced_is_run(plan, gpt, spec)
    # a plan run in another precision than it was searched in is priced in that one
    changed = dataclasses.replace(plans.best, precision="fp32")
    assert nns.simulate(changed, spec, gpt).details["training"]["dtype"] == "fp32"
    # fp8 runs (torchao's float8 training) on devices with float8 matmuls; an A100 has none
    with pytest.raises(SearchError, match="'a100-dgx' has no peak FLOP/s for 'fp8'"):
        nns.search(gpt, world_size=8, cluster=spec, progress=False, precision="fp8")


def test_sequence_parallel_plans_carry_the_sequence_splits(gpt):
    from nnscaler_plugins.lower.lowering import lower

    spec = nns.cluster("a100-dgx")
    s = Search({1: gpt}, 4, spec, [PipelineStages([1])], 4, None, False, sequence_parallel=True)
    solver = IntraSolver(gpt, s._cost_model(gpt), Training(s.dtype), (4,))
    tp = solver.evaluate(solver.walk(solver._tensor_parallel_seed()), "tensor-parallel")
    sp = solver.with_sequence_parallel(tp)
    assert sp is not None and sp.sequence_parallel and sp.key() != tp.key()
    cfg = Config(4, (4,), 1, 1, 1, 4, tp=sp.tp, sequence_parallel=True)
    plan = s.materialize(Candidate(cfg, sp, [0, len(sp.layer_segments)], 0.0, 0.0, gpt))
    plan.estimate = nns.simulate(plan, spec, gpt).to_json()
    _check_priced_is_run(plan, gpt, spec)
    counts = lower(gpt, plan).collective_counts(0)
    assert counts.get("reduce-scatter", 0) > 0  # Megatron's reduce-scatter onto the sequence runs
    # the search keeps such candidates with their splits
    plans = nns.search(gpt, world_size=4, cluster=spec, progress=False, sequence_parallel=True, max_simulated=16,
                       constraints=[PipelineStages([1])])
    for plan in plans:
        _check_priced_is_run(plan, gpt, spec)


def test_choices_the_code_generator_refuses_are_not_searched():
    """Cross-entropy split along both its class and its batch dims has no kernel: the rule's own
    localize refuses it, and the search asks the rule before it considers a choice."""
    import models

    from nnscaler_plugins.search.intraop import Choice

    model, inputs = models.gpt2_small()
    graph = nns.capture(model, kwargs=inputs)
    spec = nns.cluster("local-cpu", devices=4, measure=False)
    solver = IntraSolver(graph, CostModel(graph, spec), Training("fp32"), (2, 2))
    ce = next(op for op in graph.ops if op.short_name == "cross_entropy_loss")
    both = Choice((("n", 2), ("c", 2)))
    assert "class and batch" in solver.refusal(ce, both)
    assert solver.refusal(ce, Choice(((None, 2), ("c", 2)))) is None
    assert both not in solver.choices(ce)
    assert all(solver.refusal(op, ch) is None for op in graph.ops for ch in solver.choices(op))
