"""ZeRO-3 all-gathers the weights of float8 linears in float8 (the `fp8_all_gather` knob, torchao's
FSDP float8 all-gather): each replica casts its chunk with the scale of the whole weight (one
all-reduce of the chunks' maxima), so the gathered float8 values are those of casting the whole
weight, and the run equals the same run gathering in bf16, for a quarter of fp32's bytes.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import models

pytest.importorskip("torchao.float8")

STEPS = 4


def _batches(n: int, rows: int = 4, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, models.VOCAB, (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def zero3_fp8(rank: int, world: int, gather: bool, steps: int = STEPS) -> dict:
    """A Llama layer under zero=3, precision fp8 (emulated), trained `steps` steps in training mode
    then one eval forward: losses, whole weights after, and per parameter its gathers' bytes and
    padded elements."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.llama_small(1)
    n = batch["input_ids"].shape[0] // world

    def local(b: dict) -> dict:
        return {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}

    pm = nns.parallelize(model, local(batch), plan="dp", zero=3, precision="fp8", fp8_emulate=True,
                         fp8_all_gather=gather, cache_dir="/tmp/nns_test_cache")
    pm.train()
    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    z = pm.zero3
    losses, grad_dtypes = [], set()
    for b in _batches(steps):
        losses.append(pm.train_step(local(b)).item())
        grad_dtypes |= {str(z.chunks[k].grad.dtype) for k in z.float8_keys}
        opt.step()
        opt.zero_grad()
    pm.eval()
    with torch.no_grad():  # a forward without autograd multiplies the gathered float8 weights too
        out = pm(**local(batch))
    losses.append(float(out["loss"] if isinstance(out, dict) else out.loss))
    names = {k: z.shards[k].fqn for k in range(len(z.shards))}
    return {"losses": losses, "weights": {k: v.float() for k, v in pm.state_dict().items()},
            "float8": sorted(names[k] for k in z.float8_keys),
            "traffic": {names[k]: b for k, b in z.gathered_traffic.items()},
            "padded": {names[k]: s.size * s.chunk for k, s in enumerate(z.shards)},
            "grad_dtypes": sorted(grad_dtypes), "dtype": {names[k]: str(c.dtype) for k, c in enumerate(z.chunks)}}


def test_float8_all_gather_equals_bf16_gather_for_a_quarter_of_fp32_bytes(workers2):
    on = workers2.run(zero3_fp8, True)
    off = workers2.run(zero3_fp8, False)
    for rank in range(2):
        a, b = on[rank], off[rank]
        # every linear of the layer and the head (torchao's default: 7 + 1), nothing else
        assert len(a["float8"]) == 8 and all(n.endswith("proj.weight") or n == "lm_head.weight" for n in a["float8"])
        assert b["float8"] == []
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        for name, w in b["weights"].items():
            assert torch.equal(a["weights"][name], w), name
        assert a["losses"][-1] != a["losses"][0]  # the weights moved: the scales were recomputed each step
        # the backward is unchanged: gradients in the chunks' dtype (reduce-scattered so), master weights updated
        assert a["grad_dtypes"] == [a["dtype"][a["float8"][0]]]
        for name in a["float8"]:
            sent_fp8, sent_hp = a["traffic"][name], b["traffic"][name]
            hp_itemsize = getattr(torch, b["dtype"][name].split(".")[1]).itemsize
            gathers = sent_hp // (hp_itemsize * b["padded"][name])
            # the forward's gather every step and the eval's, and the backward's but for the head, which the
            # backward starts on while the forward's gather of it is still held
            assert gathers >= (STEPS + 1 if name == "lm_head.weight" else 2 * STEPS + 1), (name, gathers)
            fp32 = gathers * b["padded"][name] * torch.float32.itemsize
            assert sent_fp8 * 4 == fp32, (name, sent_fp8, fp32)  # float8: a quarter of fp32's bytes
        others = set(a["traffic"]) - set(a["float8"])
        assert others and all(a["traffic"][n] == b["traffic"][n] for n in others)  # norms, embedding: as before


def test_knob_refused_where_it_cannot_apply_and_kept_in_plan_files(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.plan.plan import Plan

    model, batch = models.mlp()

    def plan(**kw):
        return nns.plan(model, strategy="dp", world_size=2, example_inputs=batch, **kw)

    with pytest.raises(PlanError, match=r"fp8_all_gather=True with fp8_recipe='rowwise'.*tensorwise"):
        plan(precision="fp8", zero=3, fp8_recipe="rowwise", fp8_all_gather=True)
    with pytest.raises(PlanError, match=r"fp8_all_gather=True cannot apply.*ZeRO-3.*zero=2"):
        plan(precision="fp8", zero=2, fp8_all_gather=True)
    with pytest.raises(PlanError, match=r"fp8_all_gather=True cannot apply.*precision='bf16'"):
        plan(precision="bf16", zero=3, fp8_all_gather=True)
    with pytest.raises(PlanError, match=r"did you mean 'fp8_all_gather'"):
        plan(precision="fp8", zero=3, fp8_all_gaher=True)
    # unset: on where it applies, off elsewhere (rowwise gathers in bf16 without complaint)
    assert plan(precision="fp8", zero=3, fp8_recipe="rowwise").knobs.fp8_all_gather is None
    p = plan(precision="fp8", zero=3, fp8_all_gather=False)
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").knobs.fp8_all_gather is False


def test_simulator_prices_float8_gathers_at_one_byte_an_element():
    """Under ZeRO-3 with fp8_all_gather the weights of float8 linears are priced at 1 byte an
    element on the wire (bf16: 2), the rest as before, and they reach their products already cast:
    the forward differs by exactly the network's time for those weights' extra bytes plus the
    products' casts of their weights."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.plan.float8 import float8_linears, float8_weights
    from nnscaler_plugins.search.costmodel import CostModel
    from nnscaler_plugins.search.layouts import Placement
    from nnscaler_plugins.search.simulator import training_of

    torch.manual_seed(0)
    model, batch = models.llama_small(2)
    graph = nns.capture(model, batch)
    cluster = nns.cluster("h100-dgx")
    est = {}
    for gather in (True, False):
        plan = nns.plan(graph, strategy="dp", world_size=8, precision="fp8", zero=3, fp8_all_gather=gather,
                        overlap_param_gather=False)  # gathers exposed, so they show in the forward's time
        est[gather] = nns.simulate(plan, cluster)
    weights = float8_weights(graph)
    assert est[True].details["training"]["fp8_all_gather"] == len(weights) == 15
    assert "fp8_all_gather" not in est[False].details["training"]
    numel = {v: math.prod(graph.meta(v).shape) for v, x in graph.values.items()
             if x.kind == "param" and graph.meta(v).requires_grad}
    f8 = sum(numel[v] for v in weights)
    rest = sum(n for v, n in numel.items() if v not in weights)
    cm = CostModel(graph, cluster)
    span = cm.replica_span((0,), 1, 8, lambda d: d)
    want = cm.net.all_gather(2 * (f8 + rest), span) - cm.net.all_gather(f8 + 2 * rest, span)
    # the weight casts the products skip: each float8 linear's forward, priced both ways
    gathered = dataclasses.replace(training_of(plan, cluster), fp8_ops=frozenset(float8_linears(graph)))
    cast_here = dataclasses.replace(gathered, fp8_gathered=frozenset(weights))
    casts = 0.0
    for name in float8_linears(graph):
        p = Placement.of(plan.ops[name])
        casts += cm.op_time(name, p, gathered).fwd - cm.op_time(name, p, cast_here).fwd
        assert cm.op_time(name, p, gathered).bwd_weight == cm.op_time(name, p, cast_here).bwd_weight
    got = est[False].details["stage_fwd_s"][0] - est[True].details["stage_fwd_s"][0]
    assert want > 0 and casts > 0 and got == pytest.approx(want + casts, rel=1e-6), (got, want, casts)
