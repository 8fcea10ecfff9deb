"""ZeRO 1/2/3: equivalence with one process on the global batch, alone (dp=2) and with tensor
parallelism (tp=2 x dp=2), and per-rank memory of parameters, gradients and optimizer state
against the ZeRO formulas.

Every worker computes the single-process reference itself (CPU fp32 is deterministic). All stages
run inside one task per world size, so each module starts its process group once.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import models

STAGES = (1, 2, 3)


def slice_batch(inputs: dict, dp_rank: int, dp: int) -> dict:
    n = next(iter(inputs.values())).shape[0] // dp
    return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in inputs.items()}


def global_loss(loss: torch.Tensor, plan, world: int) -> torch.Tensor:
    """Each rank holds its replica's loss: the global one is the mean over every rank."""
    loss = loss.detach().clone().float()
    if plan.dp > 1:
        torch.distributed.all_reduce(loss)
        loss = loss / world
    return loss


def local_grads(opt) -> dict[str, torch.Tensor]:
    """This rank's (unscaled, fp32) gradient pieces, as the optimizer sees them before its step."""
    opt._prepare()
    return {e.fqn: e.master.grad for e in opt.entries if e.master.grad is not None}


def expected_piece(pm, opt, fqn: str, full: torch.Tensor) -> torch.Tensor:
    """The piece of a whole tensor that entry `fqn` of this rank holds (tp piece, then ZeRO chunk)."""
    e = next(e for e in opt.entries if e.fqn == fqn)
    key = next(v for v in pm.held_keys if pm.program.shards[v].fqn == fqn)
    piece = pm.program.shards[key].layout.slice_full(full, pm.unit_device).reshape(-1)
    if e.mode in ("chunk", "zero3") and e.shard.size > 1:
        piece = e.shard.owned(piece)
    return piece.reshape(e.master.shape)


def compare_state(pm, ref: torch.nn.Module, what: str, rtol: float, atol: float) -> list[str]:
    problems = []
    full = pm.full_state_dict()
    for k, t in ref.state_dict().items():
        if k in full and not torch.allclose(full[k].float(), t.float(), rtol=rtol, atol=atol):
            problems.append(f"{what}: {k} max abs diff {(full[k].float() - t.float()).abs().max().item():.3g}")
    return problems


def train_and_compare(rank: int, world: int, pm, opt, ref, ref_opt, inputs: dict, what: str, steps: int,
                      rtol: float, atol: float, check_grads: bool) -> list[str]:
    from nnscaler_plugins.outputs import extract_loss

    problems = []
    local = slice_batch(inputs, pm.dp_rank, pm.dp_size)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(steps):
        loss = global_loss(pm.train_step(local), pm.plan, world)
        ref_loss = extract_loss(ref(**inputs))
        ref_loss.backward()
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{what} step {step}: loss {loss.item()} vs {ref_loss.item()}")
        if check_grads:
            for fqn, g in local_grads(opt).items():
                want = expected_piece(pm, opt, fqn, ref_params[fqn].grad)
                if not torch.allclose(g, want, rtol=1e-5, atol=1e-6):
                    problems.append(f"{what} step {step}: grad {fqn} max abs diff {(g - want).abs().max().item():.3g}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        problems += compare_state(pm, ref, f"{what} step {step}", rtol, atol)
    return problems


def check_full_optimizer_state(pm, opt, ref, ref_opt, what: str) -> list[str]:
    """full_state_dict() holds torch's own AdamW state under parameter names (whole tensors), and
    load_full_state_dict() of it into a fresh optimizer gives back this rank's exact pieces."""
    import nnscaler_plugins as nns

    problems = []
    full = opt.full_state_dict()
    named = dict(ref.named_parameters())
    for fqn, st in full["state"].items():
        want = ref_opt.state[named[fqn]] if fqn in named else None
        if want is None:
            continue
        for k in ("exp_avg", "exp_avg_sq"):
            if not torch.allclose(st[k], want[k], rtol=1e-4, atol=1e-7):
                problems.append(f"{what}: full_state_dict {fqn}.{k} differs from torch's AdamW state")
        if float(st["step"]) != float(want["step"]):
            problems.append(f"{what}: step {st['step']} vs {want['step']}")
    if sorted(full["param_groups"][0]["params"]) != sorted(e.fqn for e in opt.entries):
        problems.append(f"{what}: param_groups do not name this rank's parameters")
    fresh = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    fresh.load_full_state_dict(full)
    for e, f in zip(opt.entries, fresh.entries):
        for k, v in opt.state[e.master].items():
            if not torch.equal(torch.as_tensor(v), torch.as_tensor(fresh.state[f.master][k])):
                problems.append(f"{what}: load_full_state_dict gave another {e.fqn}.{k}")
    return problems


def model_state_bytes(pm, opt) -> dict[str, int]:
    """Measured bytes this rank holds: parameters, gradients, optimizer state (masters that are
    copies plus every state tensor)."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    params = nbytes(p for p in pm.parameters())
    grads = [p.grad for p in pm.parameters() if p.grad is not None]
    if pm.grad_reducer is not None:
        grads += list(pm.grad_reducer.shard_grads.values())
    state = [e.master for e in opt.entries if e.master is not e.param]
    for st in opt.state.values():
        state += [v for v in st.values() if torch.is_tensor(v) and v.dim() >= 1]
    return {"params": params, "grads": nbytes(grads), "optimizer": nbytes(state)}


def zero_formula(psi: int, d: int, stage: int, precision: str) -> dict[str, float]:
    """ZeRO paper's model-state bytes per device for Adam: mixed precision 2 + 2 + 12 bytes per
    parameter (fp16 params, fp16 grads, fp32 master + two moments); the fp32 analogue is 4 + 4 +
    12, whose master is the parameter itself where the parameter is fp32 and whole on the rank
    (stage 0) or already the chunk (stage 3): 4 + 4 + 8 there."""
    p, g = (4, 4) if precision == "fp32" else (2, 2)
    own_master = precision != "fp32" or stage in (1, 2)
    k = 12 if own_master else 8
    return {"params": p * psi / (d if stage >= 3 else 1), "grads": g * psi / (d if stage >= 2 else 1),
            "optimizer": k * psi / (d if stage >= 1 else 1)}


def memory_check(pm, opt, psi: int, stage: int, precision: str, what: str) -> list[str]:
    """After a backward (gradients present) and a step (state present): within 10% of the formula."""
    got = model_state_bytes(pm, opt)
    want = zero_formula(psi, pm.dp_size, stage, precision)
    return [f"{what}: {k} {got[k]} B vs formula {want[k]:.0f} B" for k in got
            if abs(got[k] - want[k]) > 0.1 * want[k]]


def run_stages(rank: int, world: int, strategy: str, options: dict, stages=STAGES) -> list[str]:
    """Per ZeRO stage: SGD for 3 steps checked exactly (losses, every local gradient piece, every
    parameter), AdamW for 3 steps with a tolerance, and the model-state memory against the formula."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    # the graph of one micro-batch of one replica
    per = world // options.get("tp", 1) // options.get("pp", 1) * options.get("micro_batches", 1)
    graph = nns.capture(copy.deepcopy(base), kwargs=slice_batch(inputs, 0, per))
    problems = []
    for stage in stages:
        model = copy.deepcopy(base)
        plan = nns.plan(graph, strategy=strategy, world_size=world, zero=stage, **options)
        assert plan.zero == stage
        pm = nns.parallelize(model, slice_batch(inputs, rank // plan.unit_size, plan.dp), plan=plan,
                             cache_dir="/tmp/nns_test_cache")
        ref = copy.deepcopy(base)
        opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        problems += train_and_compare(rank, world, pm, opt, ref, ref_opt, inputs, f"zero{stage} SGD", 3,
                                      rtol=1e-5, atol=1e-6, check_grads=True)

        pm.load_full_state_dict(initial)  # the same module again from the start, for AdamW
        ref = copy.deepcopy(base)
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        # Adam divides each update by the gradient's running magnitude: a last-bit difference in a
        # tiny gradient (another summation order across shards) moves a weight by a visible fraction
        # of one step. 5e-5 absolute is 5% of one step at lr 1e-3, far below any real divergence.
        problems += train_and_compare(rank, world, pm, opt, ref, ref_opt, inputs, f"zero{stage} AdamW", 3,
                                      rtol=1e-5, atol=5e-5, check_grads=False)
        problems += check_full_optimizer_state(pm, opt, ref, ref_opt, f"zero{stage}")
        if stage == 3:
            pm.zero3.peak_gathered_bytes = pm.zero3.gathered_bytes
        pm.train_step(slice_batch(inputs, pm.dp_rank, pm.dp_size))
        psi = sum(fs.numel for fs in pm.zero_shards.values())
        if stage == 3:
            problems += just_in_time_check(pm, f"zero3 on {strategy}")
        problems += memory_check(pm, opt, psi, stage, "fp32", f"zero{stage} memory")
    return problems


def just_in_time_check(pm, what: str) -> list[str]:
    """ZeRO-3's forward holds whole parameters only around their use: the peak of gathered bytes
    stays well under all of them (the tied embedding, read first and last, is the one held long)."""
    total = sum(fs.numel * 4 for fs in pm.zero_shards.values())
    peak = pm.zero3.peak_gathered_bytes
    if not 0 < peak < 0.5 * total:  # measured: 22 % (tp 2 x dp 2, GPT-2 with 2 layers)
        return [f"{what}: {peak} bytes of whole parameters alive at once in the forward, of {total} in all"]
    return []


def test_zero_stages_dp2(workers2):
    problems = workers2.run(run_stages, "dp", {})
    assert not any(problems), problems


def test_zero_stages_tp2_dp2(workers4):
    problems = workers4.run(run_stages, "hybrid", {"tp": 2, "dp": 2})
    assert not any(problems), problems


def test_zero_stages_with_pipeline_pp2_dp2(workers4):
    """ZeRO 1, 2 and 3 under a 1F1B pipeline of 2 stages x 2 replicas: the same exact checks. Under
    stage 3 each stage gathers its own parameters as it runs and reduces their gradients after its
    last backward; the tied embedding's two copies (first and last stage) are summed across stages."""
    problems = workers4.run(run_stages, "1f1b", {"pp": 2, "dp": 2, "micro_batches": 2})
    assert not any(problems), problems


def run_plain_optimizer(rank: int, world: int, strategy: str, options: dict) -> list[str]:
    """A plain torch optimizer over module.parameters() under each ZeRO stage trains exactly like one
    process: stage 1 keeps whole gradients and steps whole parameters, stage 3's parameters are the
    chunks, and stage 2, whose gradient chunks only nns.build_optimizer's optimizer reads, keeps
    whole gradients in .grad while no such optimizer exists (and says so once, on rank 0)."""
    import warnings

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    problems = []
    for stage in STAGES:
        pm = nns.parallelize(copy.deepcopy(base), slice_batch(inputs, rank // options.get("tp", 1), world //
                                                              options.get("tp", 1)),
                             plan=strategy, zero=stage, cache_dir="/tmp/nns_test_cache", **options)
        ref = copy.deepcopy(base)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            problems += train_and_compare(rank, world, pm, opt, ref, ref_opt, inputs, f"zero{stage} plain SGD", 2,
                                          rtol=1e-5, atol=1e-6, check_grads=False)
        said = [w for w in caught if "without nns.build_optimizer" in str(w.message)]
        if len(said) != (1 if stage == 2 and rank == 0 else 0):
            problems.append(f"zero{stage} rank {rank}: {len(said)} warning(s) about the plain optimizer")
    return problems


def test_plain_torch_optimizer_is_exact_under_every_stage(workers2, workers4):
    # tp x dp too with NNS_TEST_ALL_PLANS=1 (test_zero_stages_tp2_dp2 runs its stages with our optimizer)
    problems = workers2.run(run_plain_optimizer, "dp", {})
    if os.environ.get("NNS_TEST_ALL_PLANS") == "1":
        problems += workers4.run(run_plain_optimizer, "hybrid", {"tp": 2, "dp": 2})
    assert not any(problems), problems


def test_zero_strategies_and_errors():
    import nnscaler_plugins as nns
    from nnscaler_plugins import PlanError

    model, inputs = models.mlp()
    half = slice_batch(inputs, 0, 2)
    for k in STAGES:
        plan = nns.plan(model, strategy=f"zero{k}", world_size=2, example_inputs=half)
        assert (plan.zero, plan.dp, plan.unit_size) == (k, 2, 1)
        assert nns.Plan.from_json(plan.to_json()).zero == k
    # plans written with the stage only in options (the search's) are read as that stage
    legacy = plan.to_json()
    legacy.pop("zero")
    legacy["options"] = {"zero": 2}
    assert nns.Plan.from_json(legacy).zero == 2
    assert nns.plan(model, strategy="tp", world_size=2, example_inputs=inputs, zero=1).zero == 1
    with pytest.raises(PlanError, match="ZeRO stage must be 0"):
        nns.plan(model, strategy="dp", world_size=2, example_inputs=half, zero=4)
    with pytest.raises(PlanError, match="zero1.*zero=2"):
        nns.plan(model, strategy="zero1", world_size=2, example_inputs=half, zero=2)
    with pytest.raises(PlanError, match="precision"):
        nns.plan(model, strategy="dp", world_size=2, example_inputs=half, precision="fp4")
    with pytest.raises(PlanError, match="zero=3 with schedule 'zero-bubble'.*gpipe, 1f1b or interleaved"):
        nns.plan(models.gpt2_small()[0], strategy="zero-bubble", world_size=4, pp=2, micro_batches=2,
                 example_inputs=models.gpt2_small()[1], zero=3)


def test_optimizer_is_a_torch_optimizer_for_schedulers():
    """One process (no process group): LR schedulers drive build_optimizer's result like a torch
    optimizer, its step honours their learning rates, and local state round-trips."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, inputs = models.mlp()
    ref = copy.deepcopy(model)
    pm = nns.parallelize(copy.deepcopy(model), inputs, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
              torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))]
    ref_scheds = [torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5),
                  torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (s + 1))]
    for _ in range(3):
        pm.train_step(inputs)
        ref(**inputs).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for s in scheds + ref_scheds:
            s.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    full = pm.full_state_dict()
    for k, t in ref.state_dict().items():
        assert torch.allclose(full[k], t, rtol=1e-6, atol=1e-7), k
    sd = opt.state_dict()
    opt2 = nns.build_optimizer(pm, torch.optim.SGD, lr=1.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    with pytest.raises(TypeError, match="build_optimizer takes the module"):
        nns.build_optimizer(model, torch.optim.SGD, lr=0.1)


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or ".ln_" in name


def run_param_groups(rank: int, world: int) -> list[str]:
    """Two parameter groups (no weight decay on biases and norms, by name) under ZeRO 1 and 3 give
    torch's AdamW with the same groups on one process; the whole state names each group's members."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    local = slice_batch(inputs, rank, world)
    problems = []
    for stage in (1, 3):
        pm = nns.parallelize(copy.deepcopy(base), local, plan="dp", zero=stage, cache_dir="/tmp/nns_test_cache")
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=1e-3, weight_decay=0.5,
                                  param_groups=[{"params": lambda n: not _no_decay(n)},
                                                {"params": _no_decay, "weight_decay": 0.0, "lr": 2e-3}])
        ref = copy.deepcopy(base)
        named = list(ref.named_parameters())
        ref_opt = torch.optim.AdamW([{"params": [p for n, p in named if not _no_decay(n)]},
                                     {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0,
                                      "lr": 2e-3}], lr=1e-3, weight_decay=0.5)
        # 1e-4 is 5% of one step of the faster group (see the AdamW note in run_stages); a group
        # given the other's learning rate or decay would be off by a whole step
        problems += train_and_compare(rank, world, pm, opt, ref, ref_opt, inputs, f"zero{stage} groups", 3,
                                      rtol=1e-5, atol=1e-4, check_grads=False)
        full = opt.full_state_dict()
        decay, no_decay = (set(g["params"]) for g in full["param_groups"])
        if not no_decay or any(not _no_decay(n) for n in no_decay) or any(_no_decay(n) for n in decay):
            problems.append(f"zero{stage}: full_state_dict groups {sorted(no_decay)[:4]}")
        if [g["weight_decay"] for g in full["param_groups"]] != [0.5, 0.0]:
            problems.append(f"zero{stage}: group hyperparameters {full['param_groups']}")
    return problems


def test_parameter_groups_by_name(workers2):
    problems = workers2.run(run_param_groups)
    assert not any(problems), problems


def test_parameter_groups_errors():
    import nnscaler_plugins as nns

    model, inputs = models.mlp()
    pm = nns.parallelize(copy.deepcopy(model), inputs, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    with pytest.raises(ValueError, match="exactly one group: in none: .*fc2"):
        nns.build_optimizer(pm, torch.optim.AdamW, param_groups=[{"params": ["fc1.weight", "fc1.bias"]}])
    with pytest.raises(ValueError, match="in several: .*fc1.weight"):
        nns.build_optimizer(pm, torch.optim.AdamW, param_groups=[{"params": lambda n: True},
                                                                 {"params": ["fc1.weight"]}])
    with pytest.raises(TypeError, match="fully-qualified names"):
        nns.build_optimizer(pm, torch.optim.AdamW, param_groups=[{"params": list(model.parameters())}])



class _TiedNet(torch.nn.Module):
    """An embedding and a head sharing one weight, with larger weights in between."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        logits = self.head(self.down(torch.relu(self.up(self.emb(ids)))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_tied_weight_is_bound_again_at_its_distant_use():
    """The generated code drops a parameter between uses that have larger parameters bound in
    between (a tied embedding and head) and binds it again, so a ZeRO-3 `_P` gathers it for each use
    instead of holding it whole through the forward; the result is unchanged."""
    import re

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, ids = _TiedNet(), torch.randint(0, 16, (2, 5))
    want = model(ids).item()
    pm = nns.parallelize(copy.deepcopy(model), {"ids": ids}, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    src = pm.generated_source()
    forward = src[src.index("\ndef forward("):]
    bound = re.findall(r"(\w+) = _P\[(\d+)\]", forward[:forward.find("\ndef ", 1) % len(forward) or None])
    times = sorted(sum(1 for _, j in bound if j == i) for i in {i for _, i in bound})
    assert times == [1, 1, 1, 1, 2], bound  # the tied weight twice, every other parameter once
    with torch.no_grad():
        assert pm(ids=ids).item() == pytest.approx(want, rel=1e-6)


# -- ZeRO-3 gathers a layer per collective ------------------------------------------------------------
def test_gather_units_are_runs_of_one_layer_capped_at_a_quarter():
    from nnscaler_plugins.runtime.params_on_use import gather_units, layer_prefix

    assert layer_prefix("transformer.h.3.mlp.c_fc.weight") == "transformer.h.3"
    assert layer_prefix("lm_head.weight") == ""
    fqns = ["wte.weight", "wpe.weight"] + [f"h.{i}.{n}" for i in range(2) for n in ("a.weight", "b.weight")] + ["ln.weight"]
    units = gather_units(fqns, [40, 10] + [10] * 4 + [1])
    assert units == [[0], [1], [2, 3], [4, 5], [6]], units  # wte alone: past a quarter of all (81 bytes)
    assert gather_units(["x.weight", "y.weight"], [10, 10], limit=15) == [[0], [1]]


def _gathers_per_step(rank: int, world: int) -> tuple[int, int]:
    import nnscaler_plugins as nns

    base, inputs = models.gpt2_small()
    pm = nns.parallelize(base, slice_batch(inputs, rank, world), plan="dp", zero=3, cache_dir="/tmp/nns_test_cache")
    pm.train_step(slice_batch(inputs, rank, world))  # the first step learns nothing more than the others
    before, reduced = pm.zero3.gathers_launched, pm.zero3.launched
    pm.train_step(slice_batch(inputs, rank, world))
    units = {u for u in pm.zero3.units().values()}
    return pm.zero3.gathers_launched - before, len(pm.zero3.shards), pm.zero3.launched - reduced, len(units)


def test_zero3_gathers_a_layer_per_collective_not_a_weight(workers2):
    """A layer's weights travel in one all-gather, in forward and again in backward, where gathering
    weight by weight pays a collective per parameter twice (56 a step for this model's 28; the
    quarter cap cuts this small model's layers in two or three)."""
    gathers, params, _, _ = workers2.run(_gathers_per_step)[0]
    assert gathers < params, (gathers, params)


def test_zero3_backward_gathers_each_unit_once(workers2):
    """Backward gathers a unit once, and never again the weights it is done with: each unit once in
    forward and once in backward, and the tied embedding once more (the head reads it again after
    the layers). When a weight backward had already used was gathered again with the rest of its
    unit, this model took 22 all-gathers a step for its 8 units."""
    gathers, _, _, units = workers2.run(_gathers_per_step)[0]
    assert gathers <= 2 * units + 1, (gathers, units)


def test_zero3_reduce_scatters_each_layer_when_its_backward_ends(workers2):
    """Gradients travel per gather unit (a layer, as FSDP's per-block reduce-scatter), not once the
    25 MiB bucket is full: for a small model that bucket holds every whole gradient to the end of
    backward (one reduction a step), where per unit each is let go as the layers below compute."""
    _, _, reductions, units = workers2.run(_gathers_per_step)[0]
    assert reductions >= units - 1 > 2, (reductions, units)  # the tied embedding's copies may share one


def _gathers_each_way(rank: int, world: int) -> dict:
    """A step's all-gathers in forward and in backward, its reduce-scatters, and what the backward
    kept of the forward's gathers, for a GPT-2 whose head is its tied embedding, in training mode."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.train()
    batch = slice_batch(inputs, rank, world)
    pm = nns.parallelize(base, batch, plan="dp", zero=3, cache_dir="/tmp/nns_test_cache")
    z = pm.zero3
    out = {}
    for _ in range(2):  # the second step is counted
        g0, r0 = z.gathers_launched, z.launched
        loss = pm(**batch).loss
        g1 = z.gathers_launched
        kept = sorted(z.shards[k].fqn for k in z.kept_for_backward)
        loss.backward()
        out = {"forward": g1 - g0, "backward": z.gathers_launched - g1, "reductions": z.launched - r0,
               "units": len(set(z.units().values())), "kept": kept, "left": len(z.kept_for_backward)}
        for c in z.chunks:
            c.grad = None
    return out


def test_zero3_backward_starts_on_what_the_forward_gathered_last(workers2):
    """The forward's last unit (the final norm, and the tied embedding read again as the head) is
    still gathered when the backward starts and reads it first, as FSDP2 leaves its root gathered:
    the backward gathers every other unit it needs once and those not at all. Gathering them again
    was one collective a step more than the forward's units, at the same moment and for the same
    bytes. They are let go once the backward is done with them."""
    r = workers2.run(_gathers_each_way)[0]
    assert "lm_head.weight" in r["kept"] or "transformer.wte.weight" in r["kept"], r
    assert "transformer.ln_f.weight" in r["kept"], r
    # the embedding unit's weights are not read by backward; the head's are held
    assert r["backward"] == r["units"] - 2, r
    assert r["left"] == 0, r


def test_zero3_a_weight_read_twice_is_gathered_once_per_forward(workers2):
    """The tied embedding, read by the embedding and again by the head after the last layer, is held
    from its first use to its second instead of gathered again (as FSDP2 holds its root's weights): one
    all-gather per unit in the forward. Gathering it again made one more a step."""
    r = workers2.run(_gathers_each_way)[0]
    assert r["forward"] == r["units"], r


def test_zero3_a_tied_weights_gradient_is_summed_before_it_travels(workers2):
    """The tied embedding's two uses (the embedding and the head) give two gradients: summed on the
    rank first, as autograd sums them in one process, and reduce-scattered once with the embedding's
    unit: one reduction per unit a step, where each use's reduce-scatter made one more."""
    r = workers2.run(_gathers_each_way)[0]
    assert r["reductions"] == r["units"], r


def _pool_use_each_way(rank: int, world: int) -> dict:
    """Buffers ZeRO-3 takes from the pool of mapped host buffers in a step's forward and in its
    backward (every size counted: the model is small), in training mode."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.runtime import host_buffers

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.train()
    batch = slice_batch(inputs, rank, world)
    pm = nns.parallelize(base, batch, plan="dp", zero=3, cache_dir="/tmp/nns_test_cache")
    taken = {"forward": 0, "backward": 0}
    pool, bound = host_buffers.POOL, host_buffers.MAPPED_BYTES
    take = pool.take

    def counted(nbytes: int):
        taken["backward" if torch._C._current_autograd_node() is not None else "forward"] += 1
        return take(nbytes)

    pool.take, host_buffers.MAPPED_BYTES = counted, 0
    try:
        for _ in range(2):
            pm(**batch).loss.backward()
            for c in pm.zero3.chunks:
                c.grad = None
    finally:
        pool.take, host_buffers.MAPPED_BYTES = take, bound
    return taken


def test_zero3_backward_buffers_come_from_the_heap_and_the_forwards_from_the_pool(workers2):
    """The forward's gathered weights come from the pool (activations only accumulate there: a freed
    heap buffer would be reused only in part), the backward's gathers and gradient buffers from the
    heap, where they reuse the pages of the activations the backward frees as it goes. Pooled, they
    kept pages of their own resident: 7 MiB more at a GPT-2-shaped rank's peak."""
    r = workers2.run(_pool_use_each_way)[0]
    assert r["forward"] > 0 and r["backward"] == 0, r


def _zero3_gradients_are_views_of_their_reduction(rank: int, world: int) -> list[str]:
    """zero3 in training mode, gradients zeroed in place (`set_to_none=False`) between steps: each
    chunk's gradient is a view of its reduce-scatter's output (one buffer per reduction, no copy per
    parameter), the next step adds into those views, and training stays one process's."""
    import nnscaler_plugins as nns

    problems = []
    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    for m in base.modules():  # training mode with every dropout probability zero
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    base.train()
    pm = nns.parallelize(copy.deepcopy(base), slice_batch(inputs, rank, world), plan="dp", zero=3,
                         cache_dir="/tmp/nns_test_cache")
    ref = copy.deepcopy(base)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        before = pm.zero3.launched
        loss = global_loss(pm.train_step(slice_batch(inputs, rank, world)), pm.plan, world)
        reductions = pm.zero3.launched - before
        ref_loss = ref(**inputs).loss
        ref_loss.backward()
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"step {step}: loss {loss.item()} vs {ref_loss.item()}")
        storages = {c.grad.untyped_storage().data_ptr() for c in pm.zero3.chunks if c.grad is not None}
        if len(storages) > reductions:
            problems.append(f"step {step}: {len(storages)} gradient buffers for {reductions} reductions "
                            "(copies per parameter)")
        opt.step()
        opt.zero_grad(set_to_none=False)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        problems += compare_state(pm, ref, f"step {step}", rtol=1e-5, atol=1e-6)
    return problems


def test_zero3_gradients_are_views_of_their_reduction_and_train_exactly(workers2):
    problems = workers2.run(_zero3_gradients_are_views_of_their_reduction)
    assert not any(problems), problems
