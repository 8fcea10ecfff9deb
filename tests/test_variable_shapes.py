"""Batches of other sizes than the example's, under every strategy, against one process.

Each step draws a new global batch: another batch size, another length, replicas holding
different lengths (each pads only to its own longest, as a per-batch padding collator does) and
labels of -100 in varying amounts. The reference is one process on the whole batch, padded to the
longest length with ignored labels (causal models: padding at the end changes nothing before it),
so the losses and gradients compared are token-weighted over every replica and micro-batch.
"""
from __future__ import annotations

import os

import pytest
import torch

import models
from sgd_check import step_and_compare

# (strategy, options, world): the plans of test_equivalence and test_pipeline, at world 2 unless said.
# The default suite runs one plan of each mechanism (its time budget); NNS_TEST_ALL_PLANS=1 runs
# every strategy the variable-shapes issue names (ZeRO-1/2 and GPipe share their paths with ZeRO-3,
# dp and 1F1B; hybrid is tp x dp at world 4).
EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
CASES = [
    ("dp", {}, 2),
    ("tp", {}, 2),
    ("megatron", {"tp": 2, "sequence_parallel": True}, 2),
    *([("dp", {"zero": 1}, 2), ("dp", {"zero": 2}, 2)] if EVERY else []),
    ("dp", {"zero": 3}, 2),
    *([("gpipe", {"pp": 2, "micro_batches": 2}, 2)] if EVERY else []),
    ("1f1b", {"pp": 2, "micro_batches": 2}, 2),
    ("interleaved", {"pp": 2, "virtual_stages": 2, "micro_batches": 2}, 2),
    ("zero-bubble", {"pp": 2, "micro_batches": 2}, 2),
    ("coshard", {"chunks": 2}, 2),
    ("interlaced", {"pp": 2, "micro_batches": 2}, 2),
    *([("auto", {}, 2)] if EVERY else []),  # auto's plan is one of the above
    *([("hybrid", {"tp": 2, "dp": 2}, 4)] if EVERY else []),
]
# Per step, each replica's (batch size, length); the example is (2, 16) per replica.
STEPS = [[(2, 16), (2, 16)], [(2, 10), (1, 14)], [(3, 8), (2, 6)]]


def _batch(seed: int, b: int, s: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (b, s), generator=g)
    labels = ids.clone()
    labels[:, : int(torch.randint(0, s // 2 + 1, (), generator=g))] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels}


def _pad(batch: dict, s: int) -> dict:
    n = s - batch["input_ids"].shape[1]
    return {"input_ids": torch.nn.functional.pad(batch["input_ids"], (0, n), value=0),
            "labels": torch.nn.functional.pad(batch["labels"], (0, n), value=-100)}


def run_varying(rank: int, world: int, builder: str, strategy: str, options: dict, steps=STEPS) -> list[str]:
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    name, _, layers = builder.partition(":")
    build = (lambda: getattr(models, name)(int(layers))) if layers else getattr(models, name)
    torch.manual_seed(0)
    ref, _ = build()
    torch.manual_seed(0)
    model, _ = build()
    ref.eval()
    model.eval()
    m = options.get("micro_batches", 1)  # every micro-batch holds 1 to 3 samples
    plan = nns.plan(model, strategy=strategy, world_size=world, example_inputs=_batch(0, 2 * m, 16), **options)
    dp = plan.dp
    replica = rank // plan.unit_size
    pm = nns.parallelize(model, _batch(0, 2 * m, 16), plan=plan, cache_dir="/tmp/nns_test_cache")
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    problems = []
    split = plan.mesh.axes.get("batch", 1)  # a batch split inside the unit (auto's) needs sizes it divides
    for step, sizes in enumerate(steps):
        sizes = sizes[:dp] if dp > 1 else [sizes[0]]
        sizes = [(-(-b // split) * split, s) for b, s in sizes]
        parts = [_batch(100 * step + r, b * m, s) for r, (b, s) in enumerate(sizes)]
        longest = max(s for _, s in sizes)
        whole = {k: torch.cat([_pad(p, longest)[k] for p in parts]) for k in parts[0]}
        ref_loss = extract_loss(ref(**whole))
        ref_loss.backward()
        if step == len(steps) - 1 and dp == 1 and plan.num_micro_batches == 1:
            loss = extract_loss(pm(**parts[replica]))  # DDP-style forward + backward at yet another shape
            loss.backward()
            loss = loss.detach().clone()
        else:
            loss = pm.train_step(parts[replica]).detach().clone()
        if dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        problems += step_and_compare(pm, ref, (opt, ref_opt), loss, ref_loss, f"{strategy} step {step} {sizes}")
    return problems


@pytest.mark.parametrize("strategy,options,world", CASES, ids=[f"{c[0]}{c[1] or ''}" for c in CASES])
def test_other_sizes_train_like_one_process(request, strategy, options, world):
    workers = request.getfixturevalue("workers2" if world == 2 else "workers4")
    builder = "gpt2_small:4" if strategy == "interleaved" else "gpt2_small"
    problems = workers.run(run_varying, builder, strategy, options)
    assert not [p for ps in problems for p in ps], problems


@pytest.mark.skipif(not EVERY, reason="NNS_TEST_ALL_PLANS=1 (Llama's packed rows under dp, tp and 1f1b run always)")
def test_llama_other_sizes_under_tp_and_1f1b(workers2):
    for strategy, options in (("tp", {}), ("1f1b", {"pp": 2, "micro_batches": 2})):
        problems = workers2.run(run_varying, "llama_small", strategy, options)
        assert not [p for ps in problems for p in ps], (strategy, problems)


def refused_odd_length(rank: int, world: int) -> str:
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, _ = models.gpt2_small()
    pm = nns.parallelize(model, _batch(0, 2, 16), plan="megatron", tp=2, sequence_parallel=True,
                         cache_dir="/tmp/nns_test_cache")
    pm.train_step(_batch(1, 2, 10))
    try:
        pm.train_step(_batch(2, 2, 9))
    except PlanError as e:
        pm.train_step(_batch(3, 2, 12))  # nothing was left half-done: the next batch runs
        return str(e)
    return "accepted"


def test_a_length_the_split_cannot_take_is_refused_by_name(workers2):
    messages = workers2.run(refused_odd_length)
    for m in messages:
        assert "input 'input_ids'.shape[1] is 9" in m and "divisible by 2" in m, m


def refused_on_one_replica(rank: int, world: int) -> str:
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, _ = models.gpt2_small()
    pm = nns.parallelize(model, _batch(0, 2, 16), plan="dp", micro_batches=2, cache_dir="/tmp/nns_test_cache")
    try:
        pm.train_step(_batch(1, 1 if rank == 1 else 2, 16))  # one replica's batch cannot be cut in two
    except PlanError as e:
        return str(e)
    return "accepted"


def test_a_replica_refusing_stops_every_rank_before_any_collective(workers2):
    first, second = workers2.run(refused_on_one_replica, timeout=120)
    assert "another data-parallel replica" in first, first
    assert "cannot be cut into 2 micro-batches" in second, second


def refused_while_the_other_ran_its_forward(rank: int, world: int) -> tuple[str, list[float]]:
    """A forward that only computes (no dropout, no collective) runs while the replicas agree on the
    step's sizes: the replica whose batch fits has run its first forward when the refusal arrives."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError
    from test_forward_locality import gpt2_without_dropout

    torch.manual_seed(0)
    model, _ = gpt2_without_dropout()
    pm = nns.parallelize(model, _batch(0, 2, 16), plan="dp", micro_batches=2, cache_dir="/tmp/nns_test_cache")
    assert pm.program.forward_is_local(pm.unit_device)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    try:
        pm.train_step(_batch(1, 1 if rank == 1 else 2, 16))
        message = "accepted"
    except PlanError as e:
        message = str(e)
    pm.train_step(_batch(2, 2, 16))  # nothing was left half-done: the replicas step on together
    opt.step()
    sums = [float(p.detach().double().sum()) for p in pm.parameters()]
    return message, sums


def test_a_replica_refusing_while_the_other_runs_its_forward_leaves_them_alike(workers2):
    (first, weights0), (second, weights1) = workers2.run(refused_while_the_other_ran_its_forward, timeout=120)
    assert "another data-parallel replica" in first, first
    assert "cannot be cut into 2 micro-batches" in second, second
    assert weights0 == weights1  # the same weights after the next step: the thrown-away forward left no trace


class _Windowed(torch.nn.Module):
    """Reads at most the last `window` positions: a size the model clamps (min(S, window)) is S
    for every length the fit saw, and the window beyond them."""

    window = 40

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = min(x.shape[1], self.window)
        keep = torch.nn.functional.pad(x.new_ones(1, s, 1), (0, 0, 0, x.shape[1] - s))  # the first s positions
        return torch.nn.functional.mse_loss((self.lin(x) * keep).sum(1) / s, y)


def clamped_length(rank: int, world: int) -> list[float]:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model = _Windowed()
    ref = _Windowed()
    ref.load_state_dict(model.state_dict())
    pm = nns.parallelize(model, {"x": torch.randn(2, 16, 8), "y": torch.randn(2, 8)}, plan="dp",
                         cache_dir="/tmp/nns_test_cache")
    diffs = []
    for s in (20, 48, 36):  # 48 lies beyond the sizes the fit saw, where the model clamps to 40
        g = torch.Generator().manual_seed(s)
        batch = {"x": torch.randn(2, s, 8, generator=g), "y": torch.randn(2, 8, generator=g)}
        with torch.no_grad():
            diffs.append(abs(pm(**batch).item() - ref(**batch).item()))
    return diffs


def test_a_size_beyond_the_fitted_range_is_checked_before_it_runs(workers2):
    for diffs in workers2.run(clamped_length):
        assert max(diffs) < 1e-6, diffs


class _Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(x).mean(1), y)


def test_the_first_fit_reaches_four_times_below_and_above_so_a_stream_stops_no_more():
    """The one-time fit checks its program at a quarter of the smallest and four times the largest
    size it was fitted at: sizes a padding collator brings later in that range need no capture (each
    one a stall of a step), and compute what the model computes."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, ref = _Pooled(), _Pooled()
    ref.load_state_dict(model.state_dict())
    pm = nns.parallelize(model, {"x": torch.randn(4, 16, 8), "y": torch.randn(4, 8)}, plan="dp", world_size=1,
                         cache_dir="/tmp/nns_test_cache")
    programs = pm.shape_programs
    made = []
    generate = programs._generate
    programs._generate = lambda *a, **k: made.append(a[1]) or generate(*a, **k)

    def run(b: int, s: int) -> float:
        g = torch.Generator().manual_seed(s)
        batch = {"x": torch.randn(b, s, 8, generator=g), "y": torch.randn(b, 8, generator=g)}
        with torch.no_grad():
            return abs(pm(**batch).item() - ref(**batch).item())

    assert run(4, 20) < 1e-6  # the first other size: the one-time fit, probes included
    fitted = len(made)
    assert fitted >= 3, made
    for b, s in ((4, 6), (4, 100), (2, 120), (12, 8), (4, 33)):
        assert run(b, s) < 1e-6, (b, s)
    assert len(made) == fitted, f"captures after the fit at sizes {made[fitted:]}"


def refused_under_zero3(rank: int, world: int) -> tuple[str, float]:
    """ZeRO-3 starts gathering the forward's first layer beside the step's agreement on sizes, on every
    rank and before any refusal: a replica refusing its batch has launched the same collectives as the
    other, so the next step pairs them up again (a gather left unmatched would hang it or mix buffers)."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError
    from test_forward_locality import gpt2_without_dropout

    torch.manual_seed(0)
    model, _ = gpt2_without_dropout()  # training mode, every replica's forward the same function
    pm = nns.parallelize(model, _batch(0, 2, 16), plan="zero3", micro_batches=2, cache_dir="/tmp/nns_test_cache")
    pm.train_step(_batch(1, 2, 16))
    try:
        pm.train_step(_batch(2, 1 if rank == 1 else 2, 16))
        message = "accepted"
    except PlanError as e:
        message = str(e)
    loss = pm.train_step(_batch(3, 2, 16))  # the same batch on both ranks: the same loss if the weights agree
    return message, float(loss)


def test_a_replica_refusing_under_zero3_leaves_the_collectives_paired(workers2):
    (first, loss0), (second, loss1) = workers2.run(refused_under_zero3, timeout=120)
    assert "another data-parallel replica" in first, first
    assert "cannot be cut into 2 micro-batches" in second, second
    assert loss0 == loss1
