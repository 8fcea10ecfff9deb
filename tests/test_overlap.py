"""Communication hidden behind compute, as the simulator prices it (search/overlap.py): every switch a
preset prices on is one the runtime runs, and running it changes no number.

- tensor-parallel collectives fused with the matmuls next to them (lower/tp_overlap.py,
  kernels/tp_matmul.py): the kernels against the collective and the matmul run one after the
  other, in chunks and out of piece order; plans with them against one process;
- ZeRO-1/2's gathers of the updated weights left in flight for the next forward
  (zero.PendingGather): training, gradient accumulation and a checkpoint in between against one
  process, and the gathers really waited for one bucket at a time inside the forward;
- the experts' all-to-alls beside a shared expert (kernels/expert_dispatch.py);
- `not_run_as_priced` empty for the built-in strategies on every preset.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import models


# -- kernels -----------------------------------------------------------------------------------------
def _reference_gathered(x_pieces, ws, bs, forms, dim, blocks):
    from nnscaler_plugins.layout import cat_dim

    xg = cat_dim(x_pieces, dim, blocks)
    outs = []
    for f, w, b in zip(forms, ws, bs):
        rows = xg.reshape(-1, xg.shape[-1])
        if f == "addmm":
            y = torch.addmm(b, rows, w)
        elif f == "linear":
            y = torch.nn.functional.linear(rows, w, b)
        else:
            y = rows @ w
        outs.append(y)
    return outs


def kernel_cases(rank: int, world: int) -> list[str]:
    """The fused kernels give the numbers (and gradients) of the collective and the matmul run one
    after the other, with blocked splits, pieces held out of group-rank order and 1 or `world` chunks."""
    import torch.distributed as dist

    from nnscaler_plugins.kernels import tp_matmul
    from nnscaler_plugins.layout import cat_dim, chunk_dim

    problems = []
    group = dist.new_group(list(range(world)))
    for overlap in (False, True):
        for order in (tuple(range(world)), tuple(reversed(range(world)))):
            for blocks in (1, 2):
                torch.manual_seed(0)
                b_, s_, k_, n1, n2 = 2, 4 * world, 8, 6, 5
                x_whole = torch.randn(b_ * s_, k_)  # rows: batch-major, split along the sequence (blocks = batch)
                w1, bias1 = torch.randn(k_, n1), torch.randn(n1)
                w2 = torch.randn(n2, k_)
                pieces = [chunk_dim(x_whole, 0, world, j, blocks) for j in range(world)]
                me = order.index(rank)
                x = pieces[me].clone().requires_grad_()
                ws = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
                b1 = bias1.clone().requires_grad_()
                y1, y2 = tp_matmul.gathered_matmuls(x, ws[0], b1, ws[1], None, forms=["addmm", "linear"],
                                                    shape=[-1, k_], gather=[0, blocks, list(order)],
                                                    grad="reduce-scatter", overlap=overlap, group=group)
                ref_x = x_whole.clone().requires_grad_()
                rw = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
                rb = bias1.clone().requires_grad_()
                r1, r2 = _reference_gathered([chunk_dim(ref_x, 0, world, j, blocks) for j in range(world)],
                                             rw, [rb, None], ["addmm", "linear"], 0, blocks)
                g1, g2 = torch.randn_like(r1), torch.randn_like(r2)
                ((y1 * g1).sum() + (y2 * g2).sum()).backward()
                # every device's output gradient is a share: the input gradient is their sum
                ((r1 * g1).sum() * world + (r2 * g2).sum() * world).backward()
                what = f"gathered overlap={overlap} order={order} blocks={blocks}"
                for name, got, want in [("y1", y1, r1), ("y2", y2, r2),
                                        ("dx", x.grad, chunk_dim(ref_x.grad, 0, world, me, blocks)),
                                        ("dw1", ws[0].grad, rw[0].grad / world),
                                        ("db1", b1.grad, rb.grad / world), ("dw2", ws[1].grad, rw[1].grad / world)]:
                    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                        problems.append(f"{what}: {name} max abs diff {(got - want).abs().max().item():.3g}")

                # a row-parallel matmul: partial sums reduce-scattered (or all-reduced) along the rows
                for scatter in (True, False):
                    torch.manual_seed(1 + rank)  # each device its own partial input
                    xp = torch.randn(b_ * s_, k_, requires_grad=True)
                    w = torch.randn(n1, k_, requires_grad=True)
                    bias = torch.randn(n1, requires_grad=True)
                    y = tp_matmul.reduced_matmul("linear", xp, w, bias, shape=[b_, s_, n1],
                                                 scatter=[1, 1, list(order)] if scatter else None,
                                                 overlap=overlap, group=group)
                    full = torch.nn.functional.linear(xp.detach(), w.detach(), bias.detach()).view(b_, s_, n1)
                    dist.all_reduce(full, group=group)
                    want = chunk_dim(full, 1, world, me, 1) if scatter else full
                    what2 = f"reduced scatter={scatter} overlap={overlap} order={order}"
                    if not torch.allclose(y, want, rtol=1e-5, atol=1e-5):
                        problems.append(f"{what2}: y max abs diff {(y - want).abs().max().item():.3g}")
                    gy = torch.randn_like(y)
                    (y * gy).sum().backward()
                    gfull = cat_dim(_gather_all(gy, 1, group, order), 1) if scatter else gy
                    xr, wr, br = xp.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(), \
                        bias.detach().clone().requires_grad_()
                    (torch.nn.functional.linear(xr, wr, br).view(b_, s_, n1) * gfull).sum().backward()
                    for name, got, ref in [("dx", xp.grad, xr.grad), ("dw", w.grad, wr.grad), ("db", bias.grad, br.grad)]:
                        if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
                            problems.append(f"{what2}: {name} max abs diff {(got - ref).abs().max().item():.3g}")
    return problems


def _gather_all(t, dim, group, order):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in order]
    dist.all_gather(parts, t.contiguous(), group=group)
    return [parts[g] for g in order]


def test_tp_kernels_match_collective_then_matmul_2(workers2):
    problems = workers2.run(kernel_cases)
    assert not any(problems), problems


def test_chunk_count_follows_switch_and_backend():
    from nnscaler_plugins.kernels import tp_matmul

    assert tp_matmul.chunk_count(None, True, 8) == 1  # one device: nothing to pipeline
    assert tp_matmul.chunk_count(None, None, 8) == 1


# -- plans ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
@pytest.mark.parametrize("sp", [False, True])
def test_tp_overlap_plans_train_like_one_process_2(workers2, name, sp):
    """tp_comm_overlap=True pipelines the collectives in 2 chunks even on gloo: training mode, SGD
    exact and AdamW, against one process."""
    from test_equivalence import run_case

    options = {"tp": 2, "sequence_parallel": sp, "tp_comm_overlap": True}
    problems = workers2.run(run_case, name, "megatron", options, train=True)
    assert not any(problems), problems


@pytest.mark.skipif(os.environ.get("NNS_TEST_ALL_PLANS") != "1", reason="world-4 plans run with NNS_TEST_ALL_PLANS=1")
def test_tp_overlap_sequence_parallel_4(workers4):
    from test_equivalence import run_case

    problems = workers4.run(run_case, "llama_small", "megatron", {"tp": 4, "sequence_parallel": True,
                                                                   "tp_comm_overlap": True}, train=True)
    assert not any(problems), problems


def count_pipelined_gathers(rank: int, world: int, overlap) -> dict:
    """Asynchronous all-gathers one forward of a sequence-parallel plan starts, and the fused calls."""
    import torch.distributed as dist

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, inputs = models.llama_small()
    plan = nns.plan(model, strategy="megatron", world_size=world, example_inputs=inputs, tp=world,
                    sequence_parallel=True, tp_comm_overlap=overlap)
    pm = nns.parallelize(model, inputs, plan=plan, cache_dir="/tmp/nns_test_cache")
    calls = {"async": 0}
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls["async"] += bool(kwargs.get("async_op"))
        return real(*args, **kwargs)

    dist.all_gather = counting
    try:
        pm.train_step(inputs)
    finally:
        dist.all_gather = real
    return {"async": calls["async"], "fused": pm.generated_source().count("gathered_matmuls(")}


def test_sequence_parallel_gathers_run_in_chunks_2(workers2):
    """On gloo the default runs each fused all-gather whole (collectives share the compute cores);
    tp_comm_overlap=True cuts each into 2 pipelined chunks, and False keeps the unfused statements."""
    on = workers2.run(count_pipelined_gathers, True)[0]
    default = workers2.run(count_pipelined_gathers, None)[0]
    off = workers2.run(count_pipelined_gathers, False)[0]
    layers = 2
    # q/k/v and gate/up read one gathered input each per layer, plus the LM head
    assert on["fused"] == default["fused"] > 0 and off["fused"] == 0
    gathered, reduced = 2 * layers + 1, 2 * layers  # + o_proj and down_proj, reduce-scattered
    # gathered inputs: chunks in forward, one regather in backward; reduce-scattered outputs: their
    # gradient gathered back in chunks
    assert on["async"] == gathered * (2 + 1) + reduced * 2, on
    assert default["async"] == gathered * (1 + 1) + reduced * 1, default


# -- the simulator's word ---------------------------------------------------------------------------------
# Every registered strategy with options that plan a GPT-2-shaped model (a Mixtral-shaped one for ep)
# at world 8; "auto" searches, on the preset it is priced on.
STRATEGY_OPTIONS = {
    "dp": [{}], "tp": [{}], "megatron": [{"tp": 8}, {"tp": 4, "pp": 2}, {"tp": 8, "sequence_parallel": True}],
    "hybrid": [{"tp": 2, "dp": 4}], "zero1": [{}], "zero2": [{}], "zero3": [{}], "coshard": [{}],
    "1f1b": [{"pp": 2, "micro_batches": 4}], "gpipe": [{"pp": 2, "micro_batches": 4}],
    "interleaved": [{"pp": 2, "micro_batches": 4}], "zero-bubble": [{"pp": 2, "micro_batches": 4}],
    "interlaced": [{"pp": 2, "micro_batches": 4}], "pipeline": [{"pp": 2, "micro_batches": 4}],
    "cp": [{"cp": 2}, {"cp": 2, "tp": 2}], "ep": [{"ep": 8}, {"ep": 4, "tp": 2}], "auto": [{}],
}


@pytest.fixture(scope="module")
def plans():
    """Every case's plan (made once: a plan does not depend on the cluster it is priced on) and the
    GPT-2-shaped graph "auto" searches."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    import nnscaler_plugins as nns

    cfg = GPT2Config(n_layer=4, n_embd=1024, n_head=8, vocab_size=4096, n_positions=512, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(cfg).eval()
    ids = torch.zeros(8, 512, dtype=torch.long, device="meta")
    graph = nns.capture(gpt2, kwargs={"input_ids": ids, "labels": ids})
    mc = transformers.MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
                                    num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(mc)
    mids = torch.zeros(8, 128, dtype=torch.long)
    made = {}
    for strategy, cases in STRATEGY_OPTIONS.items():
        for options in cases:
            if strategy == "ep":
                made[(strategy, str(options))] = nns.plan(mixtral, strategy="ep", world_size=8,
                                                          example_inputs={"input_ids": mids, "labels": mids},
                                                          **options)
            elif strategy != "auto":
                made[(strategy, str(options))] = nns.plan(graph, strategy=strategy, world_size=8, **options)
    return graph, made


@pytest.mark.parametrize("preset", ["v100-p3", "a100-dgx", "h100-dgx", "h200", "local-cpu"])
def test_every_plan_runs_as_priced(plans, preset):
    """`simulate(plan, cluster).details` lists no switch the runtime does not run, for every built-in
    strategy on every preset (the Hopper presets price tensor-parallel overlap and ZeRO-1/2's gather
    under the next forward on by default)."""
    import nnscaler_plugins as nns

    assert set(STRATEGY_OPTIONS) == set(nns.strategies()), "a strategy without a case here"
    graph, made = plans
    spec = nns.cluster(preset, devices=8, measure=False) if preset == "local-cpu" else nns.cluster(preset)
    if preset == "h100-dgx":  # a search per preset would take minutes; the Hopper stack prices every switch on
        made = {**made, ("auto", "{}"): nns.plan(graph, strategy="auto", world_size=8, cluster=spec)}
    found = {key: nns.simulate(plan, spec).details.get("not_run_as_priced", []) for key, plan in made.items()}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


# -- ZeRO-1/2: updated weights gathered under the next forward ------------------------------------------------
def zero_gather_run(rank: int, world: int, stage: int, overlap, root: str) -> list[str]:
    """Training mode (dropout 0), 2 micro-batches accumulated per step, SGD with momentum, a
    checkpoint saved right after a step (gathers in flight) and loaded into a fresh module and
    optimizer that carry on: losses and weights against one process on the global batch. Also
    whether the gathers are left in flight by the step and settled one bucket at a time inside the
    forward."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    from test_equivalence import global_batch, slice_batch

    ref, inputs = global_batch("gpt2_small", train=True)
    base, _ = global_batch("gpt2_small", train=True)
    options = dict(zero=stage, micro_batches=2, overlap_param_gather=overlap)
    local = slice_batch(inputs, rank, world)

    def build():
        pm = nns.parallelize(copy.deepcopy(base), local, plan="dp", cache_dir="/tmp/nns_test_cache", **options)
        pm.param_gather.bucket_bytes = 16 * 1024  # several buckets even for a small model
        return pm, nns.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)

    pm, opt = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    problems, in_flight = [], []
    for step in range(5):
        if step == 1:  # the first forward after a step: record the buckets in flight as it waits for each
            real = pm.param_gather.wait_for

            def recording(t, real=real):
                real(t)
                in_flight.append(pm.param_gather.in_flight)
            pm.param_gather.wait_for = recording
        loss = pm.train_step(local).detach().clone()
        if step == 1:
            del pm.param_gather.wait_for
        torch.distributed.all_reduce(loss)
        ref_loss = extract_loss(ref(**inputs))
        ref_loss.backward()
        if not torch.allclose(loss / world, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"zero{stage} overlap={overlap} step {step}: loss {loss.item() / world} vs {ref_loss.item()}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if pm.param_gather.pending != (overlap is not False):
            problems.append(f"zero{stage} overlap={overlap}: gathers in flight after the step: {pm.param_gather.pending}")
        if step == 2:  # saved with the gathers in flight, loaded into fresh ones
            path = os.path.join(root, f"zero{stage}_{overlap}")
            nns.checkpoint.save(path, pm, opt)
            pm, opt = build()
            nns.checkpoint.load(path, pm, opt)
    full = pm.full_state_dict()
    for k, t in ref.state_dict().items():
        if k in full and not torch.allclose(full[k], t, rtol=1e-5, atol=1e-6):
            problems.append(f"zero{stage} overlap={overlap}: {k} max abs diff {(full[k] - t).abs().max().item():.3g}")
    if overlap is not False and not (in_flight and in_flight[0] > 0 and in_flight[-1] == 0):
        problems.append(f"zero{stage}: buckets in flight as the forward read its weights: {in_flight}")
    return problems


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [None, False])
def test_zero_gathers_under_next_forward_2(workers2, tmp_path, stage, overlap):
    problems = workers2.run(zero_gather_run, stage, overlap, str(tmp_path))
    assert not any(problems), problems


# -- experts' all-to-alls beside a shared expert --------------------------------------------------------------
def shared_expert_run(rank: int, world: int) -> dict:
    """Qwen2-MoE (a shared expert beside the routed ones) under ep 2: SGD against one process, the
    all-to-alls (forward's and backward's) started asynchronously, and the shared expert's matmuls placed between the dispatch's
    start and its wait in the generated code."""
    from collective_counts import all_to_alls
    from sgd_check import sgd_equivalence
    from test_expert_parallel import qwen2_moe

    with all_to_alls() as calls:
        problems = sgd_equivalence(rank, world, qwen2_moe, "ep", {"ep": 2}, 1, what="qwen2_moe ep 2")
    import nnscaler_plugins as nns

    compiled = nns.compile(qwen2_moe()[0], qwen2_moe()[1], "ep", world_size=world, ep=2,
                           cache_dir="/tmp/nns_test_cache")
    return {"problems": problems, "calls": calls, "source": compiled.artifact(rank).source()}


def test_expert_all_to_alls_beside_shared_expert_2(workers2):
    for r in workers2.run(shared_expert_run):
        assert not r["problems"], r["problems"]
        forward = r["source"].split("\ndef forward_loss(")[0]
        lines = forward.splitlines()
        starts = [i for i, line in enumerate(lines) if "expert_dispatch_start(" in line]
        computes = [i for i, line in enumerate(lines) if "expert_dispatch_compute(" in line]
        finishes = [i for i, line in enumerate(lines) if "expert_dispatch_finish(" in line]
        assert len(starts) == len(computes) == len(finishes) == 2, (starts, computes, finishes)
        for a, b, c in zip(starts, computes, finishes):
            assert any("shared_expert_gate_proj_weight)" in line for line in lines[a:b]), lines[a:b]  # beside the dispatch
            assert any("shared_expert_gate_weight)" in line for line in lines[b:c]), lines[b:c]  # beside the combine
        # every all-to-all of the experts started asynchronously: forward's dispatch and combine (2 per layer
        # per step) and, in backward, their reverse exchanges, started before the shared expert's backward
        assert r["calls"]["async"] == r["calls"]["all"] == 2 * 2 * 2 * 2, r["calls"]
