"""The eager executor: models capture cannot take run under dp and ZeRO 1-3 exactly like one process.

Each model of tests/eager_models.py reads data-dependent sizes or values in Python (a masked-LM head
selecting tokens with `nonzero`, `.item()`-driven control flow, boolean indexing of detection anchors
beside batch norm). Capture refuses them; under a plan that keeps whole layers on each device the
module runs them as they are, in training mode (batch norm with the whole global batch's statistics):
after SGD steps every parameter and buffer equals one process on the global batch. A checkpoint saved
under either executor loads into the other and training goes on the same; plans that split ops refuse
such a model by name, naming the plans that run it; `executor="captured"` refuses it.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from conftest import ALL_PLANS
from eager_models import BUILDERS
from sgd_check import replica_batch, sgd_equivalence

CACHE = "/tmp/nns_test_cache"
STRATEGIES = ["dp", "zero1", "zero2", "zero3"]


def _equivalence(rank: int, world: int, name: str, strategy: str, options: dict) -> tuple[list[str], str, str]:
    import nnscaler_plugins as nns  # noqa: F401 - registers the strategies in the worker

    problems = sgd_equivalence(rank, world, BUILDERS[name], strategy, options, dp=world, steps=3, training=True,
                               what=f"{name} {strategy}")
    torch.manual_seed(0)
    model, batch = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model.train(), replica_batch(batch, rank, world), plan=strategy, cache_dir=CACHE,
                             **options)
    return problems, pm.plan.explain(), pm.generated_source()


CASES = [(n, s) for n in BUILDERS for s in STRATEGIES] if ALL_PLANS else \
    [("masked_lm", "dp"), ("masked_lm", "zero3"), ("item", "zero1"), ("item", "zero2"), ("detection", "dp"),
     ("detection", "zero3"), ("penalty", "zero3")]


@pytest.mark.parametrize("name,strategy", CASES)
def test_models_capture_cannot_take_train_like_one_process(workers2, name, strategy):
    out = workers2.run(_equivalence, name, strategy, {})
    problems, explain, source = out[0]
    assert problems == [] and out[1][0] == [], problems or out[1][0]
    assert "eager" in explain and "capture failed" in explain, explain
    assert "No code was generated" in source and "capture failed" in source


def _bn_local_differs(rank: int, world: int) -> list[str]:
    """With batch_statistics='local' each replica normalizes with its own rows: the run must then
    differ from one process (the test above can fail)."""
    return sgd_equivalence(rank, world, BUILDERS["detection"], "dp", {"batch_statistics": "local"}, dp=world,
                           steps=2, training=True)


def test_batch_norm_statistics_are_the_global_batchs(workers2):
    problems = workers2.run(_bn_local_differs)[0]
    assert any("bn.running_mean" in p or "conv.weight" in p for p in problems), problems


def _captured_model() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    return model, {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)}


class _WithLoss(torch.nn.Module):
    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def _cross_load(rank: int, world: int, save_executor: str, load_executor: str, strategy: str, path: str) -> list:
    import nnscaler_plugins as nns

    net, batch = _captured_model()
    local = replica_batch(batch, rank, world)

    def build(executor: str):
        torch.manual_seed(0)
        m = _WithLoss(_captured_model()[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = nns.parallelize(m, local, plan=strategy, cache_dir=CACHE, executor=executor)
        return pm, nns.build_optimizer(pm, torch.optim.AdamW, lr=0.01)

    a, opt_a = build(save_executor)
    for _ in range(2):
        a.train_step(local)
        opt_a.step()
        opt_a.zero_grad()
    handle = nns.checkpoint.save(path, a, opt_a, background=save_executor == "eager")
    if not isinstance(handle, str):  # written in the background while training could go on
        handle.wait()
    b, opt_b = build(load_executor)
    nns.checkpoint.load(path, b, opt_b)
    losses = []
    for pm, opt in ((a, opt_a), (b, opt_b)):
        loss = pm.train_step(local)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return [a.plan.knobs.executor, b.plan.knobs.executor, losses,
            max((sa[k] - sb[k]).abs().max().item() for k in sa)]


@pytest.mark.parametrize("save,load,strategy", [("eager", "auto", "zero3"), ("auto", "eager", "zero1")])
def test_a_checkpoint_of_either_executor_loads_into_the_other(workers2, tmp_path, save, load, strategy):
    out = workers2.run(_cross_load, save, load, strategy, str(tmp_path / "ckpt"))
    ex_a, ex_b, losses, diff = out[0]
    assert (ex_a, ex_b) == ({"eager": "eager", "auto": "auto"}[save], {"eager": "eager", "auto": "auto"}[load])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and diff < 1e-6, (losses, diff)


def test_plans_that_split_ops_refuse_by_name_and_name_the_plans_that_run():
    import nnscaler_plugins as nns
    from nnscaler_plugins.capture.tracing import CaptureError

    model, batch = BUILDERS["masked_lm"]()
    for strategy, options in (("tp", {}), ("1f1b", {"pp": 2, "micro_batches": 2})):
        with pytest.raises(CaptureError, match="nonzero") as e:
            nns.plan(model, strategy=strategy, world_size=2, example_inputs=batch, **options)
        assert "plan='dp', 'zero1', 'zero2' or 'zero3'" in str(e.value)
    plan = nns.plan(model, strategy="zero3", world_size=4, example_inputs=batch)
    assert plan.knobs.executor == "eager" and "nonzero" in plan.knobs.eager_reason and plan.zero == 3
    assert "eager" in plan.explain() and "ZeRO-3" in plan.explain()
    with pytest.raises(CaptureError, match="nonzero"):
        nns.parallelize(model, batch, plan="dp", executor="captured", cache_dir=CACHE)
    with pytest.raises(nns.PlanError, match="executor="):
        nns.parallelize(model, batch, plan="dp", executor="eagre", cache_dir=CACHE)


def test_one_process_eager_equals_the_model_in_training_mode():
    """World 1, dropout on: the eager executor draws from the process's generator as the model does."""
    import nnscaler_plugins as nns

    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            h = self.drop(torch.relu(self.a(x)))
            return self.b(h[h.sum(-1) > 0]).mean()  # a data-dependent row count

    torch.manual_seed(0)
    ref = Drop()
    model = Drop()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(16, 8)
    pm = nns.parallelize(model, (x,), plan="dp", cache_dir=CACHE)
    assert pm.plan.knobs.executor == "eager"
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        torch.manual_seed(11)
        loss = pm.train_step((x,))
        torch.manual_seed(11)
        ref_loss = ref(x)
        ref_loss.backward()
        assert float(loss) == pytest.approx(ref_loss.item(), rel=1e-6)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = pm.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(full[k], v, rtol=1e-6, atol=1e-7), k
    pm.eval()
    assert not model.training and not model.drop.training


def _eager_vs_captured(rank: int, world: int, model_name: str, strategy: str, options: dict) -> dict:
    """The same plan, captured and eager, on the same replica batches: SGD steps in training mode."""
    import models
    import nnscaler_plugins as nns

    out = {}
    for executor in ("auto", "eager"):
        torch.manual_seed(0)
        model, batch = models.ALL[model_name]()
        for m in model.modules():  # the executors draw dropout masks differently: compare without
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model.train()
        local = replica_batch(batch, rank, world)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = nns.parallelize(model, local, plan=strategy, cache_dir=CACHE, executor=executor, **options)
        opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)  # SGD: the exact check (Adam amplifies rounding)
        losses = []
        for _ in range(3):
            losses.append(float(pm.train_step(local)))
            opt.step()
            opt.zero_grad()
        out[executor] = (pm.plan.knobs.executor, losses, {k: v.float() for k, v in pm.full_state_dict().items()})
    return out


EAGER_VS_CAPTURED = [("gpt2_small", "zero3", {}), ("llama_small", "dp", {"zero": 2, "offload": "optimizer"}),
                     ("gpt2_small", "zero3", {"offload": "params", "precision": "bf16"})]
if ALL_PLANS:
    EAGER_VS_CAPTURED += [("llama_small", "zero1", {}), ("gpt2_small", "dp", {"precision": "bf16"}),
                          ("bert_small", "zero3", {"offload": "optimizer"})]


@pytest.mark.parametrize("model_name,strategy,options", EAGER_VS_CAPTURED)
def test_eager_trains_as_the_captured_path_does(workers2, model_name, strategy, options):
    """Where capture works, executor='eager' computes what the generated code computes (dropout is 0 in
    these configs: the two executors draw masks differently)."""
    out = workers2.run(_eager_vs_captured, model_name, strategy, options)[0]
    (ex_c, loss_c, w_c), (ex_e, loss_e, w_e) = out["auto"], out["eager"]
    assert (ex_c, ex_e) == ("auto", "eager")
    tol = 2e-2 if options.get("precision") == "bf16" else 1e-5
    assert loss_e == pytest.approx(loss_c, rel=tol), (loss_c, loss_e)
    worst = max(((w_c[k] - w_e[k]).abs().max().item() / (w_c[k].abs().max().item() + 1e-12), k) for k in w_c)
    assert worst[0] < (5e-2 if tol > 1e-5 else 1e-5), worst


def _nonfinite_eager(rank: int, world: int, strategy: str) -> dict:
    """One good step, then a weight of rank 1 set to NaN: under dp its copy of the final norm's weight
    (the norm's output is the first non-finite one, on rank 1 only), under ZeRO-3 its chunk of the
    embedding (gathered whole, every rank's embedding output is non-finite)."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = BUILDERS["masked_lm"]()
    local = replica_batch(batch, rank, world)
    pm = nns.parallelize(model, local, plan=strategy, cache_dir=CACHE)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pm.train_step(local)
    opt.step()
    opt.zero_grad()
    if rank == 1:
        with torch.no_grad():
            pm.parameter("norm.weight" if strategy == "dp" else "embed.weight").fill_(float("nan"))
    pm.train_step(local)
    before = pm.full_state_dict()
    try:
        opt.step()
    except nns.NonFiniteError as e:
        after = pm.full_state_dict()
        return {"error": str(e), "op": e.op, "rank": e.rank,
                "unchanged": all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)}
    return {}


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_nonfinite_is_named_by_module_before_any_weight_changes(workers2, strategy):
    results = workers2.run(_nonfinite_eager, strategy)
    for r in results:
        assert r and r["unchanged"], r
    assert len({r["error"] for r in results}) == 1  # the same error on every rank
    r = results[0]
    if strategy == "dp":
        assert r["rank"] == 1 and r["op"].startswith("norm (LayerNorm)"), r
    else:
        assert r["op"].startswith("embed (Embedding)"), r
    assert " at " in r["op"] and ".py:" in r["op"], r  # where the module's forward is written


def test_the_hf_trainer_trains_a_model_capture_cannot_take_as_the_plain_trainer(tmp_path):
    """NNScalerTrainer under zero3 on 2 processes: the head selecting tokens with nonzero runs eagerly,
    its logged losses the plain Trainer's (DDP) on the same data and seed."""
    from torchrun_jobs import run_job

    plain, ours = run_job(tmp_path, "hf_eager_job.py", "plain"), run_job(tmp_path, "hf_eager_job.py", "zero3")
    assert ours["executor"] == "eager" and len(plain["losses"]) == 3, (plain, ours)
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5), (plain, ours)


def _optimizer_made_before(rank: int, world: int) -> list:
    """DDP's contract: an optimizer over model.parameters() made before wrapping steps the model."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    ref, batch = BUILDERS["item"]()
    torch.manual_seed(0)
    model, _ = BUILDERS["item"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pm = nns.parallelize(model, replica_batch(batch, rank, world), plan="dp", cache_dir=CACHE)
    for _ in range(2):
        pm.train_step(replica_batch(batch, rank, world))
        opt.step()
        opt.zero_grad()
        ref(**batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_state_dict()
    return [k for k, v in ref.state_dict().items() if not torch.allclose(full[k], v, rtol=1e-5, atol=1e-6)]


def test_an_optimizer_made_before_parallelizing_steps_the_trained_weights(workers2):
    assert workers2.run(_optimizer_made_before) == [[], []]
