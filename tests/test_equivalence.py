"""The core property: every plan trains exactly like one process on the same global batch.

Each worker also computes the single-process reference itself (CPU fp32 is deterministic), so
the comparison happens where the shards are: local gradients and parameters are compared with
the matching piece of the reference's full tensors, taken through the plan's own layouts.
"""
from __future__ import annotations

import pytest
import torch

import models

CASES = [
    # (model builder, strategy, options)
    ("mlp", "dp", {}),
    ("mlp", "tp", {}),
    ("mlp", "custom_mlp", {}),
    ("gpt2_small", "dp", {}),
    ("gpt2_small", "tp", {}),
    ("llama_small", "dp", {}),
    ("llama_small", "tp", {}),
]
HYBRID = [("mlp", "hybrid"), ("gpt2_small", "hybrid"), ("llama_small", "hybrid")]
# Models no strategy was written for: tp finds its splits from the dimension rules alone.
UNSEEN = ["bert_small", "vit_hf"]


def split_linears(builder, **_):
    """A user-written plan: column-split every linear with a weight parameter, replicate the rest."""
    from nnscaler_plugins import op_assign, op_trans

    n = builder.unit_size
    for op in builder.ops:
        labels = op.signature.inputs[1] if len(op.signature.inputs) > 1 else None
        is_linear = op.node.op_name.startswith("aten.linear") and builder.graph.values[op.node.inputs[1]].kind == "param"
        if is_linear and labels and op.splittable(labels[0], n):
            for device, sub in enumerate(op_trans(op, dim=labels[0], num=n)):
                op_assign(sub, device)
        else:
            builder.replicate(op)


def global_batch(name: str, train: bool = False):
    """The model and its global batch; dropout off (pieces would otherwise draw other masks than the
    reference): by eval(), or with `train` in training mode with every dropout probability zero."""
    torch.manual_seed(0)
    model, inputs = getattr(models, name)()
    if train:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model.train()
    else:
        model.eval()
    return model, inputs


def slice_batch(inputs: dict, dp_rank: int, dp: int) -> dict:
    out = {}
    for k, v in inputs.items():
        n = v.shape[0] // dp
        out[k] = v[dp_rank * n:(dp_rank + 1) * n]
    return out


def _compare_grads(pm, ref_params: dict, what: str, rtol: float = 1e-5) -> list[str]:
    """Every local gradient against the matching piece of the reference's full gradient."""
    problems = []
    for v in pm.held_keys:
        s = pm.program.shards[v]
        if s.kind != "param" or ref_params[s.fqn].grad is None:
            continue
        mine = pm.parameter(s.fqn).grad
        want = s.layout.slice_full(ref_params[s.fqn].grad, pm.unit_device)
        if mine is None or not torch.allclose(mine, want, rtol=rtol, atol=1e-6):
            err = (mine - want).abs().max().item() if mine is not None else "missing"
            problems.append(f"{what}: grad of {s.fqn} differs (max abs {err})")
    return problems


def _compare_params(pm, ref_params: dict, what: str, rtol: float, atol: float) -> list[str]:
    problems = []
    for v in pm.held_keys:
        s = pm.program.shards[v]
        if s.kind == "param":
            want = s.layout.slice_full(ref_params[s.fqn].detach(), pm.unit_device)
            got = pm.parameter(s.fqn).detach()
            if not torch.allclose(got, want, rtol=rtol, atol=atol):
                problems.append(f"{what}: param {s.fqn} max abs diff {(got - want).abs().max().item():.3g}")
    return problems


def _global_loss(loss: torch.Tensor, plan, world: int) -> torch.Tensor:
    """Every rank of a replica holds its replica's loss: the global one is the mean over all ranks."""
    if plan.dp > 1:
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss)
        loss = loss / world
    return loss


def run_case(rank: int, world: int, name: str, strategy, options: dict, steps: int = 3, train: bool = False):
    """Two trainings from the same start, each against a single-process reference:

    SGD, checked exactly (losses, every gradient and every parameter after every step, fp32
    relative 1e-5), driving the module three ways: `train_step`, DDP-style `forward` +
    `loss.backward()`, and two batches accumulated under `no_sync()`; then AdamW for `steps` steps.
    `train`: the models in training mode (dropout probabilities zero) instead of eval().
    """
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    if strategy == "custom_mlp":
        strategy = split_linears
    ref_model, inputs = global_batch(name, train)
    model, _ = global_batch(name, train)
    initial = {k: v.clone() for k, v in ref_model.state_dict().items()}
    plan = nns.plan(model, strategy=strategy, world_size=world, example_inputs=slice_batch(inputs, 0, _dp(strategy, world, options)), **options)
    dp = plan.dp
    second = {k: v.roll(1, 0) for k, v in inputs.items()}  # another global batch of the same shapes
    local = lambda batch: slice_batch(batch, rank // plan.unit_size, dp)  # noqa: E731
    pm = nns.parallelize(model, local(inputs), plan=plan, cache_dir="/tmp/nns_test_cache")
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    problems = []

    def check_loss(what, loss, ref_loss):
        loss = _global_loss(loss, plan, world)
        if not torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{what}: loss {loss.item()} vs {ref_loss.item()}")

    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step, mode in enumerate(("train_step", "forward_backward", "no_sync")):
        what = f"SGD step {step} ({mode})"
        if mode == "train_step":
            ref_loss = extract_loss(ref_model(**inputs))
            ref_loss.backward()
            check_loss(what, pm.train_step(local(inputs)), ref_loss)
        elif mode == "forward_backward":
            ref_loss = extract_loss(ref_model(**inputs))
            ref_loss.backward()
            loss = extract_loss(pm(**local(inputs)))
            loss.backward()
            check_loss(what, loss, ref_loss)
        else:
            for batch in (inputs, second):
                extract_loss(ref_model(**batch)).backward()
            reducer = pm.grad_reducer
            before = reducer.launched if reducer is not None else 0
            with pm.no_sync():
                pm.train_step(local(inputs))
            if reducer is not None and reducer.launched != before:
                problems.append(f"{what}: gradients were reduced inside no_sync()")
            pm.train_step(local(second))
            if reducer is not None and reducer.launched == before:
                problems.append(f"{what}: gradients were not reduced after no_sync()")
        problems += _compare_grads(pm, ref_params, what)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        problems += _compare_params(pm, ref_params, what, rtol=1e-5, atol=1e-6)

    ref_model.load_state_dict(initial)
    pm.load_full_state_dict(initial)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(steps):
        ref_loss = extract_loss(ref_model(**inputs))
        ref_loss.backward()
        check_loss(f"AdamW step {step}", pm.train_step(local(inputs)), ref_loss)
        if step == 0:
            problems += _compare_grads(pm, ref_params, f"AdamW step {step}")
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    # Adam divides each update by the gradient's own running magnitude, so a last-bit difference in
    # a tiny gradient (a different summation order across shards) can move a weight by a visible
    # fraction of one step. lr is 1e-3: 5e-5 absolute is 5% of a single step's size, far below any
    # real divergence; the exact check of parameters is the SGD run above.
    problems += _compare_params(pm, ref_params, f"after {steps} AdamW steps", rtol=1e-5, atol=5e-5)
    full = pm.full_state_dict()
    for k, t in ref_model.state_dict().items():
        if k in full and not torch.allclose(full[k], t, rtol=1e-5, atol=5e-5):
            problems.append(f"full_state_dict[{k}] differs")
    return problems


def _dp(strategy, world: int, options: dict) -> int:
    if strategy == "dp":
        return world
    if strategy == "hybrid":
        return options.get("dp", world // options.get("tp", 2))
    return 1


@pytest.mark.parametrize("name,strategy,options", CASES)
def test_equivalence_2(workers2, name, strategy, options):
    problems = workers2.run(run_case, name, strategy, options)
    assert not any(problems), problems


@pytest.mark.parametrize("name,strategy,options", CASES)
def test_equivalence_4(workers4, name, strategy, options):
    problems = workers4.run(run_case, name, strategy, options)
    assert not any(problems), problems


@pytest.mark.parametrize("name,strategy", HYBRID)
def test_equivalence_hybrid_4(workers4, name, strategy):
    problems = workers4.run(run_case, name, strategy, {"tp": 2, "dp": 2})
    assert not any(problems), problems


@pytest.mark.parametrize("name", ["gpt2_small", "llama_small"])
def test_equivalence_sequence_parallel_2(workers2, name):
    problems = workers2.run(run_case, name, "megatron", {"tp": 2, "sequence_parallel": True})
    assert not any(problems), problems


@pytest.mark.parametrize("name", UNSEEN)
def test_equivalence_tp_on_other_models_2(workers2, name):
    problems = workers2.run(run_case, name, "tp", {})
    assert not any(problems), problems


def _bucket_buffers_across_steps(rank: int, world: int) -> list:
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.gpt2_small(2)
    pm = nns.parallelize(model, batch, plan="dp", cache_dir="/tmp/nns_test_cache")
    seen = []  # the buffers themselves, held: a new one cannot take a freed one's place unnoticed
    for _ in range(3):
        pm.train_step(batch)
        seen.append([b.buffer if b.flat is None else b.flat for b in pm.grad_reducer.buckets])
        pm.zero_grad()
    return [len(seen[0])] + [all(a is b for a, b in zip(seen[0], later)) for later in seen[1:]]


def test_gradient_buckets_keep_their_buffers_from_step_to_step(workers2):
    """As DDP's buckets: an all-reduce's flat buffer is made once, not at every step (a fresh large
    allocation faults its pages in again); the results stay those of one process (the tests above)."""
    for buckets, *same in workers2.run(_bucket_buffers_across_steps):
        assert buckets >= 1 and same == [True, True], (buckets, same)


def _gradients_live_in_their_buckets(rank: int, world: int) -> list[str]:
    """dp in training mode, each step's gradients zeroed in place (`set_to_none=False`, the way some
    frameworks zero): the gradients accumulate into their buckets' views, the next step reduces those
    views in place, and training stays one process's; a micro-batched step (no_sync inside) too."""
    import nnscaler_plugins as nns

    problems = []
    ref, inputs = global_batch("gpt2_small", train=True)
    model, _ = global_batch("gpt2_small", train=True)
    local = slice_batch(inputs, rank, world)
    pm = nns.parallelize(model, local, plan="dp", cache_dir="/tmp/nns_test_cache")
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        batch = {k: v.roll(step, 0) for k, v in inputs.items()}
        models_loss = pm.train_step(slice_batch(batch, rank, world))
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        if not torch.allclose(_global_loss(models_loss, pm.plan, world), ref_loss.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"step {step}: loss differs")
        problems += _compare_grads(pm, ref_params, f"step {step}")
        for b in pm.grad_reducer.buckets:
            storage = b.flat.untyped_storage().data_ptr()
            apart = [p for p in b.params if p.grad is None or p.grad.untyped_storage().data_ptr() != storage]
            if apart:
                problems.append(f"step {step}: {len(apart)} reduced gradients are copies, not views of their bucket")
        opt.step()
        opt.zero_grad(set_to_none=False)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        problems += _compare_params(pm, ref_params, f"step {step}", rtol=1e-5, atol=1e-6)
    return problems


def test_reduced_gradients_are_views_of_their_buckets_and_train_exactly(workers2):
    """As DDP's gradient_as_bucket_view: no copy of the reduced gradients back out of the bucket, and
    one copy of them held between steps instead of two."""
    problems = workers2.run(_gradients_live_in_their_buckets)
    assert not any(problems), problems
