"""Every plan on every frontier the search returns runs, and trains exactly like one process.

Small GPT-2 and Llama configs are searched at world 2 and 4 on two clusters (`local-cpu` with fixed
numbers, and the A100 preset priced in fp32 so that the fp32 comparison is exact), from one
micro-batch of 2 rows and a global batch of 8, so the frontiers hold plans with several
micro-batches, data-parallel replicas, ZeRO stages, recomputation and pipelines; and as strategy
"auto" searches (data parallelism inside the unit, 2-D meshes of batch and tensor splits, here with
2 micro-batches), which gives tensor-parallel plans with and without pipelines. Each plan is run
as a user runs it: `nns.parallelize(model, batch, plan=p)` with the replica's micro-batch x
micro-batches rows, one `train_step`, one SGD step; the loss and every parameter after the step
must equal one process's (fp32, relative 1e-5). One worker task runs all plans of a model and
world size (the reference is computed once there); plans found on both clusters run once. A
sequence-parallel plan of the search (Megatron's splits of the layers' norms and residual adds)
runs the same way.
"""
from __future__ import annotations

import pytest
import torch

import nnscaler_plugins as nns

MICRO, GLOBAL, SEQ, VOCAB = 2, 8, 16, 128


def _model(name: str):
    import models

    torch.manual_seed(0)
    model, _ = getattr(models, name)()
    model.eval()  # dropout off: the pieces would draw other masks than the reference
    ids = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _key(plan) -> str:
    """What makes two plans run the same (not how they were priced or described)."""
    import json

    d = plan.to_json()
    for k in ("estimate", "options", "strategy"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True)


def _frontier_plans(name: str, world: int) -> list:
    model, batch = _model(name)
    micro = {k: v[:MICRO] for k, v in batch.items()}
    clusters = [(nns.cluster("local-cpu", devices=world, measure=False), None), (nns.cluster("a100-dgx"), "fp32")]
    plans, seen = [], set()
    searches = [nns.search(model, example_inputs=micro, world_size=world, cluster=spec, global_batch_size=GLOBAL,
                           precision=precision, progress=False) for spec, precision in clusters]
    # as strategy "auto" searches: data parallelism inside the unit (2-D meshes), here with 2
    # micro-batches of the whole step's rows
    half = {k: v[:GLOBAL // 2] for k, v in batch.items()}
    searches.append(nns.search(model, example_inputs=half, world_size=world, cluster=clusters[0][0],
                               data_parallel="unit", micro_batches=2, progress=False))
    for found in searches:
        assert len(found) >= 1
        for p in found:
            assert p.precision == "fp32" and p.num_micro_batches * p.options["micro_batch_size"] * p.dp == GLOBAL
            if _key(p) not in seen:
                seen.add(_key(p))
                plans.append(p)
    return plans


def run_plans(rank: int, world: int, name: str, plans: list) -> list[str]:
    """Each plan: parallelize, one train_step and one SGD step; loss and parameters vs one process."""
    import torch.distributed as dist

    ref_model, batch = _model(name)
    ref_loss = ref_model(**batch).loss
    ref_loss.backward()
    torch.optim.SGD(ref_model.parameters(), lr=0.1).step()
    ref_params = {k: v.detach() for k, v in ref_model.state_dict().items()}
    problems = []
    for plan in plans:
        what = plan.options.get("summary", plan.strategy)
        model, _ = _model(name)
        per = GLOBAL // plan.dp
        replica = rank // plan.unit_size
        local = {k: v[replica * per:(replica + 1) * per] for k, v in batch.items()}
        pm = nns.parallelize(model, local, plan=plan, cache_dir="/tmp/nns_test_cache")
        opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
        loss = pm.train_step(local).detach().clone()
        opt.step()
        opt.zero_grad()
        if plan.dp > 1:  # every rank holds its replica's loss: the global one is the mean over ranks
            dist.all_reduce(loss)
            loss /= world
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{what}: loss {loss.item()} vs {ref_loss.item()}")
        full = pm.full_state_dict()
        for k, want in ref_params.items():
            if k in full and not torch.allclose(full[k], want, rtol=1e-5, atol=1e-6):
                problems.append(f"{what}: {k} after the step differs by {(full[k] - want).abs().max().item():.3g}")
    return problems


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
def test_every_frontier_plan_runs_2(workers2, name):
    plans = _frontier_plans(name, 2)
    problems = workers2.run(run_plans, name, plans, timeout=900)
    assert not any(problems), problems


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
def test_every_frontier_plan_runs_4(workers4, name):
    plans = _frontier_plans(name, 4)
    problems = workers4.run(run_plans, name, plans, timeout=900)
    assert not any(problems), problems


def _sequence_parallel_plan(name: str, world: int):
    """The search's sequence-parallel variant of its tensor-parallel assignment, as a plan."""
    from nnscaler_plugins.search.costmodel import Training
    from nnscaler_plugins.search.intraop import IntraSolver
    from nnscaler_plugins.search.solver import Candidate, Search
    from nnscaler_plugins.search.space import Config

    model, batch = _model(name)
    graph = nns.capture(model, kwargs=batch)  # one replica, one micro-batch of the whole batch
    s = Search({GLOBAL: graph}, world, nns.cluster("a100-dgx"), [], GLOBAL, None, False, sequence_parallel=True,
               precision="fp32")
    solver = IntraSolver(graph, s._cost_model(graph), Training("fp32"), (world,))
    tp = solver.evaluate(solver.walk(solver._tensor_parallel_seed()), "tensor-parallel")
    sp = solver.with_sequence_parallel(tp)
    assert sp is not None and sp.sequence_parallel
    cfg = Config(world, (world,), 1, 1, GLOBAL, 1, tp=sp.tp, sequence_parallel=True)
    return s.materialize(Candidate(cfg, sp, [0, len(sp.layer_segments)], 0.0, 0.0, graph))


def test_sequence_parallel_search_plan_runs_2(workers2):
    plans = [_sequence_parallel_plan(name, 2) for name in ("gpt2_small", "llama_small")]
    for p in plans:
        assert p.knobs.sequence_parallel is True
    problems = []
    for name, plan in zip(("gpt2_small", "llama_small"), plans):
        problems += sum(workers2.run(run_plans, name, [plan], timeout=900), [])
    assert not problems, problems
