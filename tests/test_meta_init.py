"""A model built on the meta device is initialized per shard by its own initialization: the same
whole weights under tensor parallelism, data parallelism, ZeRO-3, a 1F1B pipeline and one
process, equal to `nns.init_weights` on the eager model, with a finite first loss equal to
eager's; a rank holds at most one whole tensor beyond its shards while materializing;
buffers computed in constructors are recomputed; what nothing reproduces is refused by name.
"""
from __future__ import annotations

import os

import pytest
import torch

import models

SEED = 1234
LAYERS = 2  # a pipeline's two stages hold one block each
# name -> (strategy, options, data-parallel replicas); every plan runs on 4 processes (the pipeline's
# two replicas are the data-parallel case)
PLANS = {
    "tp4": ("tp", {}, 1),
    "dp4-zero3": ("dp", {"zero": 3}, 4),
    "1f1b-pp2-dp2": ("1f1b", {"pp": 2, "micro_batches": 2}, 2),
}


def _meta(builder):
    with torch.device("meta"):
        model, inputs = builder(layers=LAYERS)
    return model.eval(), inputs  # no dropout: losses compare exactly


def _inputs(builder):
    torch.manual_seed(0)
    return builder(layers=LAYERS)[1]


def _reference(builder) -> tuple[dict[str, torch.Tensor], float]:
    """Whole weights and first loss of the eager model under the same initialization scheme."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    model = builder(layers=LAYERS)[0].eval()
    nns.init_weights(model, SEED)
    with torch.no_grad():
        loss = extract_loss(model(**_inputs(builder))).item()
    return {k: v.clone() for k, v in model.state_dict().items()}, loss


def _parallel_weights(rank: int, world: int, builder_name: str) -> dict:
    import nnscaler_plugins as nns

    builder = getattr(models, builder_name)
    inputs = _inputs(builder)
    ref, ref_loss = _reference(builder)
    out = {}
    for name, (strategy, options, dp) in PLANS.items():
        model, _ = _meta(builder)
        local = _replica(inputs, rank // (world // dp), dp)
        pm = nns.parallelize(model, local, plan=strategy, cache_dir="/tmp/nns_test_cache", init_seed=SEED, **options)
        plan = pm.plan
        assert plan.dp == dp
        assert all(t.is_meta for t in model.parameters()), "the user's model stays on the meta device"
        full = pm.full_state_dict()
        diffs = [k for k, v in ref.items() if k in full and not torch.equal(full[k], v)]
        missing = [k for k in ref if k not in full and not k.endswith("inv_freq")]
        loss = pm.train_step(local).detach().float()
        if plan.dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        out[name] = (diffs, missing, loss.item(), pm.init_peak_bytes, _held_bytes(pm))
    return {"ref_loss": ref_loss, "runs": out}


def _replica(inputs: dict, dp_rank: int, dp: int) -> dict:
    n = next(iter(inputs.values())).shape[0] // dp
    return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in inputs.items()}


def _held_bytes(pm) -> int:
    return sum(pm.local_tensor(k).numel() * pm.local_tensor(k).element_size() for k in pm.held_keys)


# GPT-2 (tied head, a parent's init rewriting a child's weight) under every plan by default; Llama
# (rotary buffers) in one process by default, under every plan with NNS_TEST_ALL_PLANS=1.
ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"


@pytest.mark.parametrize("builder_name", ["gpt2_small", "llama_small"])
def test_meta_model_gets_the_same_weights_under_every_plan(workers4, builder_name):
    import nnscaler_plugins as nns

    builder = getattr(models, builder_name)
    ref, ref_loss = _reference(builder)
    # One process, from the meta device, equals the eager reference.
    model, _ = _meta(builder)
    pm = nns.parallelize(model, _inputs(builder), plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache",
                         init_seed=SEED)
    full = pm.full_state_dict()
    assert [k for k, v in ref.items() if k in full and not torch.equal(full[k], v)] == []
    one_loss = pm.train_step(_inputs(builder)).item()
    assert one_loss == pytest.approx(ref_loss, rel=1e-5)

    if builder_name != "gpt2_small" and not ALL:
        return
    results = workers4.run(_parallel_weights, builder_name)
    biggest = max(v.numel() * v.element_size() for v in ref.values())
    for rank, r in enumerate(results):
        assert r["ref_loss"] == pytest.approx(ref_loss, rel=1e-6)
        for name, (diffs, missing, loss, peak, held) in r["runs"].items():
            assert diffs == [] and missing == [], f"rank {rank} {name}: {diffs[:4]} differ, {missing[:4]} missing"
            assert torch.isfinite(torch.tensor(loss)) and loss == pytest.approx(ref_loss, rel=1e-4), (name, loss)
            # Beyond its shards a rank held one whole tensor at a time (a tied weight only for its last writer).
            assert 0 < peak <= biggest, f"rank {rank} {name}: {peak} bytes of whole tensors at once"


def test_init_weights_is_deterministic_per_module_and_keeps_ties():
    import nnscaler_plugins as nns

    a, _ = models.gpt2_small(layers=2)
    with torch.device("meta"):
        b, _ = models.gpt2_small(layers=2)
    nns.init_weights(a, 7)
    nns.init_weights(b, 7)
    assert b.lm_head.weight is b.transformer.wte.weight
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    # GPT-2's residual projections keep their scaled init (written by the parent module's init)
    std = a.transformer.h[0].mlp.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * a.config.n_layer) ** 0.5, rel=0.2)


def test_buffers_computed_in_constructors_are_recomputed():
    from nnscaler_plugins.runtime.materialize import init_weights

    class Positions(torch.nn.Module):
        def __init__(self, n: int, d: int):
            super().__init__()
            self.n, self.d = n, d
            self.proj = torch.nn.Linear(d, d)
            self.register_buffer("pos", torch.arange(n).float() / n, persistent=False)
            self.register_buffer("mask", torch.tril(torch.ones(n, n, dtype=torch.bool)))

    with torch.device("meta"):
        m = Positions(6, 3)
    init_weights(m, 0)
    assert torch.equal(m.pos, torch.arange(6).float() / 6)
    assert torch.equal(m.mask, torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert not m.proj.weight.is_meta


def test_meta_model_without_a_reproducible_init_is_refused_by_name():
    import nnscaler_plugins as nns
    from nnscaler_plugins.runtime.materialize import InitError

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.randn(4))  # drawn in __init__: gone on meta

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    with torch.device("meta"):
        m = Scaled()
    with pytest.raises(InitError, match=r"scale \(Scaled\)"):
        nns.parallelize(m, {"x": torch.randn(2, 4)}, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")


def test_materializing_holds_one_whole_tensor_at_a_time():
    """Materializing gives every tensor `init_weights`' value while holding one whole tensor at a
    time: a tied weight is made once, by its last writer (the embedding's init, after the head's);
    a partial write after an overwrite (the padding row) sees the overwritten values; an init that
    reads another tensor still reads its final value."""
    from nnscaler_plugins.runtime.materialize import init_weights, materialize

    class Mirror(torch.nn.Module):
        def __init__(self, src: torch.nn.Linear):
            super().__init__()
            self.src = [src]  # not a child: read, not initialized, here
            self.w = torch.nn.Parameter(torch.empty(8, 8))

        def reset_parameters(self):
            with torch.no_grad():
                self.w.copy_(self.src[0].weight.t() * 2)

    def build(mirror: bool):
        m = torch.nn.Module()
        m.head = torch.nn.Linear(8, 50, bias=False)
        m.lin = torch.nn.Linear(8, 8)
        m.emb = torch.nn.Embedding(50, 8, padding_idx=3)
        m.head.weight = m.emb.weight
        if mirror:
            m.mirror = Mirror(m.lin)
        return m

    for mirror in (False, True):
        ref = init_weights(build(mirror), 5)
        with torch.device("meta"):
            meta = build(mirror)
        got = {}
        peak = materialize(meta, 5, lambda names, t: got.update({n: t.clone() for n in names}))
        want = dict(ref.named_parameters(remove_duplicate=False))
        assert sorted(got) == sorted(want)
        for n, t in want.items():
            assert torch.equal(got[n], t), n
        assert torch.equal(got["emb.weight"][3], torch.zeros(8))  # the embedding's init wrote last
        if not mirror:
            assert peak == max(t.numel() * t.element_size() for t in want.values())
