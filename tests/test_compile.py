"""compile=True: the per-rank program under torch.compile, compiled by regions between its collectives.

The guarantees: the compiled plan computes what the uncompiled one does (fp32, relative 1e-5, in
training mode with dropout on); one region per distinct layer whatever the depth; no graph made
after the first step of a shape; one graph per region for every length of a variable-size input;
every strategy (dp, tp, hybrid, ZeRO 1-3, pipelines, ep, cp). The CPU tests compile with
`compile_backend="aot_eager"` (torch.compile's tracing and autograd, no code generation): inductor
works here too (one test) but takes tens of seconds per region on two cores. More strategies run
with NNS_TEST_ALL_PLANS=1.
"""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import models

ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
BACKEND = "aot_eager"


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _pair(name: str, plan: str = "dp", train: bool = True, **options):
    """The same model parallelized twice on one process: eagerly and compiled."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = getattr(models, name)()
    model.train(train)
    twin = copy.deepcopy(model)
    eager = nns.parallelize(model, batch, plan=plan, cache_dir="/tmp/nns_test_cache", **options)
    compiled = nns.parallelize(twin, batch, plan=plan, compile=True, compile_backend=BACKEND,
                               cache_dir="/tmp/nns_test_cache", **options)
    return eager, compiled, batch


def _same_grads(a, b) -> None:
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters()):
        assert n == m
        if p.grad is None:
            assert q.grad is None, n
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


def test_regions_are_one_per_distinct_layer_whatever_the_depth():
    """The generated file holds the same region functions for 2 and 4 layers, every layer calls
    them, and a plan without compile keeps its one-statement-per-op file."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.codegen.generate import generate

    regions, sources = [], {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model, batch = models.llama_small(layers)
        compiled = nns.compile(model, batch, "tp", world_size=2, compile=True, cache_dir="/tmp/nns_test_cache")
        src = compiled.artifact(0).source()
        sources[layers] = src
        regions.append(re.findall(r"^def (_r\d+)\(", src, flags=re.M))
        for k in range(layers):  # each layer calls the same regions as layer 0
            calls = re.findall(rf"# model\.layers\.{k}: \d+ ops compiled as (_r\d+)", src)
            first = re.findall(r"# model\.layers\.0: \d+ ops compiled as (_r\d+)", src)
            assert calls and calls == first, (k, calls, first)
        plain = generate(compiled.program, 0, regions=False)
        assert "REGIONS" not in plain and "_r0(" not in plain
    assert regions[0] == regions[1] and regions[0], regions
    assert "REGIONS = (" in sources[4]


def test_compiled_plan_equals_uncompiled_in_training_and_never_recompiles():
    """GPT-2 with dropout on: the same losses and gradients step after step, and no graph is made
    after the first step (torch._dynamo's counters)."""
    eager, compiled, batch = _pair("gpt2_small")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    graphs = []
    for step in range(3):
        torch.manual_seed(step)
        le = eager.train_step(batch)
        torch.manual_seed(step)
        lc = compiled.train_step(batch)
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        _same_grads(eager, compiled)
        opt_e.step(), opt_c.step(), opt_e.zero_grad(), opt_c.zero_grad()
        graphs.append(_graphs())
    assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2], f"graphs made after each step: {graphs}"
    names = {n for n, _ in compiled.artifact.region_log.first_calls}
    assert names and compiled.artifact.torch_compile_seconds > 0
    assert set(re.findall(r"^def (_r\d+)\(", compiled.generated_source(), flags=re.M)) >= names
    # forward (every output) agrees too, without gradients (a new grad mode: graphs of its own)
    with torch.no_grad():
        torch.manual_seed(7)
        want = eager(**batch).logits
        torch.manual_seed(7)
        torch.testing.assert_close(compiled(**batch).logits, want, rtol=1e-5, atol=1e-6)


def test_variable_lengths_compile_once_per_shape_template():
    """Batches of other lengths run through the file fitted for every size, compiled with dynamic
    shapes: after its first call no length makes another graph, and every length computes what the
    uncompiled plan computes."""
    eager, compiled, batch = _pair("llama_small")
    graphs = []
    for n in (16, 24, 8, 20):
        ids = torch.randint(0, models.VOCAB, (4, n), generator=torch.Generator().manual_seed(n))
        b = {"input_ids": ids, "labels": ids.clone()}
        le, lc = eager.train_step(b), compiled.train_step(b)
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        _same_grads(eager, compiled)
        eager.zero_grad(), compiled.zero_grad()
        graphs.append(_graphs())
    # 16: the example's file; 24: the fitted file's first call makes its graphs; then none
    assert graphs[1] > graphs[0] and len(set(graphs[1:])) == 1, f"graphs after each length: {graphs}"
    assert compiled.shape_programs.fitted and not compiled.shape_programs.per_shape


def test_module_compiled_after_it_was_made():
    """`module.compile()` (what engine.compile() calls) switches a module made without the knob."""
    eager, _, batch = _pair("mlp", train=True)
    torch.manual_seed(0)
    model, _ = models.mlp()
    import nnscaler_plugins as nns

    late = nns.parallelize(model, batch, plan="dp", cache_dir="/tmp/nns_test_cache")
    assert "REGIONS" not in late.generated_source()
    late.compile(backend=BACKEND)
    assert "REGIONS = (" in late.generated_source() and late.artifact.compile_backend == BACKEND
    torch.testing.assert_close(late.train_step(batch), eager.train_step(batch), rtol=1e-5, atol=1e-6)
    _same_grads(eager, late)
    with pytest.raises(TypeError, match="backend name"):
        late.compile(mode="max-autotune")


def test_compile_knobs_in_plans_and_plan_files(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.plan.plan import Plan

    torch.manual_seed(0)
    model, batch = models.mlp()
    plan = nns.plan(model, strategy="tp", world_size=2, example_inputs=batch, compile=True, compile_backend="aot_eager")
    assert plan.knobs.compile and plan.knobs.compile_backend == "aot_eager"
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.knobs.compile and loaded.knobs.compile_backend == "aot_eager"
    with pytest.raises(PlanError, match="compile_backend='inductr'"):
        nns.plan(model, strategy="tp", world_size=2, example_inputs=batch, compile_backend="inductr")
    with pytest.raises(PlanError, match="compile=.*True or False"):
        nns.plan(model, strategy="tp", world_size=2, example_inputs=batch, compile="yes")


@pytest.mark.skipif(not ALL, reason="inductor compiles C++ for each region: about a minute on 2 cores "
                                    "(NNS_TEST_ALL_PLANS=1 runs it)")
def test_inductor_backend_equals_uncompiled():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.mlp()
    twin = copy.deepcopy(model)
    eager = nns.parallelize(model, batch, plan="dp", cache_dir="/tmp/nns_test_cache")
    compiled = nns.parallelize(twin, batch, plan="dp", compile=True, cache_dir="/tmp/nns_test_cache")
    assert compiled.artifact.compile_backend == "inductor"
    for _ in range(2):
        torch.testing.assert_close(compiled.train_step(batch), eager.train_step(batch), rtol=1e-5, atol=1e-6)
        _same_grads(eager, compiled)


# -- every strategy, in real processes ------------------------------------------------------------------

def _builder(name: str):
    if name in ("mixtral",):
        import test_expert_parallel

        return getattr(test_expert_parallel, name)
    if name.startswith("cp_"):
        import test_context_parallel

        return test_context_parallel.BUILDERS[name[3:]]
    return getattr(models, name)


def compare_compiled(rank: int, world: int, name: str, strategy: str, options: dict, dp: int, steps: int = 2):
    """Eager and compiled modules of one plan from the same weights, trained side by side with
    the sharded SGD: every loss, and the whole state after every step, equal (fp32, 1e-5)."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = _builder(name)()
    model.train()
    twin = copy.deepcopy(model)
    n = next(iter(batch.values())).shape[0] // dp
    local = {k: v[(rank % dp) * n:(rank % dp + 1) * n] if dp > 1 else v for k, v in batch.items()}
    plan = nns.plan(model, strategy=strategy, world_size=world, example_inputs=local, **options)
    if dp > 1:
        r = rank // plan.unit_size
        local = {k: v[r * n:(r + 1) * n] for k, v in batch.items()}
    eager = nns.parallelize(model, local, plan=plan, cache_dir="/tmp/nns_test_cache")
    plan_c = nns.plan(twin, strategy=strategy, world_size=world, example_inputs=local, compile=True,
                      compile_backend=BACKEND, **options)
    compiled = nns.parallelize(twin, local, plan=plan_c, cache_dir="/tmp/nns_test_cache")
    problems = []
    if "REGIONS = (" not in compiled.generated_source():
        problems.append("no compiled region in the generated file")
    opts = [nns.build_optimizer(m, torch.optim.SGD, lr=0.1) for m in (eager, compiled)]
    for step in range(steps):
        losses = []
        for m, opt in zip((eager, compiled), opts):
            torch.manual_seed(100 + step)
            losses.append(m.train_step(local))
            opt.step()
            opt.zero_grad()
        if not torch.allclose(losses[1], losses[0], rtol=1e-5, atol=1e-6):
            problems.append(f"step {step}: loss {losses[1].item()} compiled vs {losses[0].item()}")
        a, b = eager.full_state_dict(), compiled.full_state_dict()
        for k in a:
            if not torch.allclose(b[k], a[k], rtol=1e-5, atol=1e-6):
                problems.append(f"step {step}: {k} differs by {(b[k] - a[k]).abs().max().item():.3g}")
    return problems


CASES_2 = [("gpt2_small", "tp", {}, 1), ("llama_small", "dp", {"zero": 3}, 2)]
CASES_2_ALL = [("llama_small", "1f1b", {"pp": 2, "micro_batches": 2}, 1), ("gpt2_small", "dp", {}, 2), ("llama_small", "megatron", {"tp": 2, "sequence_parallel": True}, 1),
               ("llama_small", "dp", {"zero": 1}, 2), ("gpt2_small", "dp", {"zero": 2}, 2),
               ("llama_small", "gpipe", {"pp": 2, "micro_batches": 2}, 1), ("mixtral", "ep", {"ep": 2}, 1),
               ("cp_gpt2", "cp", {"cp_comm": "ring"}, 1), ("llama_small", "tp", {"recompute": "full"}, 1)]
CASES_4_ALL = [("gpt2_small", "hybrid", {"tp": 2, "dp": 2}, 2), ("llama_small", "tp", {"tp": 2, "dp": 2, "zero": 3}, 2),
               ("llama_small", "interleaved", {"pp": 2, "micro_batches": 4, "stages_per_rank": 2}, 2)]


@pytest.mark.parametrize("name,strategy,options,dp", CASES_2 + (CASES_2_ALL if ALL else []))
def test_compiled_plans_equal_uncompiled_2(workers2, name, strategy, options, dp):
    problems = workers2.run(compare_compiled, name, strategy, options, dp)
    assert not any(problems), problems


@pytest.mark.skipif(not ALL, reason="world-4 plans run with NNS_TEST_ALL_PLANS=1")
@pytest.mark.parametrize("name,strategy,options,dp", CASES_4_ALL)
def test_compiled_plans_equal_uncompiled_4(workers4, name, strategy, options, dp):
    problems = workers4.run(compare_compiled, name, strategy, options, dp)
    assert not any(problems), problems


def test_deepspeed_compile_section_and_engine_compile():
    """The config's compile.deepcompile and engine.compile() run the per-rank program compiled,
    computing what the uncompiled engine computes; compile arguments it cannot honour are refused."""
    from nnscaler_plugins.adapters import deepspeed

    def engine(extra: dict):
        torch.manual_seed(0)
        model, batch = models.mlp()
        cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "nnscaler": {"plan": "dp", "compile_backend": BACKEND}, **extra}
        return deepspeed.initialize(model=model, config=cfg, example_inputs=batch)[0], batch

    plain, batch = engine({})
    from_config, _ = engine({"compile": {"deepcompile": True}})
    late, _ = engine({})
    assert not plain.is_compiled and from_config.is_compiled and not late.is_compiled
    late.compile(backend=BACKEND)
    assert late.is_compiled and late.parallel_module.artifact.compile_backend == BACKEND
    assert from_config.parallel_module.artifact.compile_backend == BACKEND
    for _ in range(2):
        losses = []
        for e in (plain, from_config, late):
            loss = e(**batch)
            e.backward(loss)
            e.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[2], losses[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="not supported here"):
        late.compile(compile_kwargs={"mode": "max-autotune"})


def test_lightning_strategy_and_hf_arguments_pass_compile_through(tmp_path):
    """Both adapters hand plan options to their Session: compile=True becomes the plan's knob."""
    pytest.importorskip("lightning")
    from transformers import HfArgumentParser

    from nnscaler_plugins.adapters.hf import NNScalerTrainingArguments
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, batch = models.mlp()
    strategy = NNScalerStrategy(plan="dp", compile=True, compile_backend=BACKEND)
    plan = strategy.session.plan_for(model, batch, world_size=1)
    assert plan.knobs.compile and plan.knobs.compile_backend == BACKEND
    (args,) = HfArgumentParser((NNScalerTrainingArguments,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--plan", "dp", "--plan_options", '{"compile": true, "compile_backend": "aot_eager"}'])
    assert args.plan_options == {"compile": True, "compile_backend": "aot_eager"}
    with pytest.raises(PlanError, match="compile_backend='inductr'"):
        NNScalerStrategy(plan="dp", compile=True, compile_backend="inductr").session.plan_for(model, batch, world_size=1)
