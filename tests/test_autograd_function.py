"""Custom autograd Functions keep the user's own backward under every plan.

torch.export traces through `Function.apply`; without care autograd would differentiate the traced
forward and never call the user's `backward` (a straight-through estimator would get zero
gradients). Capture keeps each Function as one op that calls the class itself. These tests train
models built around such Functions under dp, tp, a 1F1B pipeline, ZeRO-3 and hybrid, and compare
with one process running the same Functions eagerly.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from sgd_check import sgd_equivalence

import nnscaler_plugins as nns
from nnscaler_plugins.capture.tracing import CaptureError
from nnscaler_plugins.hookspecs import hookimpl


class RoundSTE(torch.autograd.Function):
    """Quantize to quarters in forward; pass the gradient straight through."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    """Identity forward, gradient times -lambda backward (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class TanhAndSquare(torch.autograd.Function):
    """New-style Function (setup_context) with two outputs and a hand-written backward."""

    @staticmethod
    def forward(x):
        return torch.tanh(x), x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x, output[0])

    @staticmethod
    def backward(ctx, g_tanh, g_square):
        x, t = ctx.saved_tensors
        return g_tanh * (1 - t * t) * 0.5 + g_square * 2 * x  # deliberately not autograd's own formula


class FusedCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy with a backward written by hand (and scaled, so autograd's differs)."""

    @staticmethod
    def forward(ctx, logits, labels):
        logp = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(logp.exp(), labels)
        return -logp.gather(-1, labels.unsqueeze(-1)).mean()

    @staticmethod
    def backward(ctx, g):
        probs, labels = ctx.saved_tensors
        onehot = torch.zeros_like(probs).scatter_(-1, labels.unsqueeze(-1), 1.0)
        return g * 2.0 * (probs - onehot) / probs.shape[0], None


class Block(torch.nn.Module):
    def __init__(self, d: int, kind: str, local_fn=None):
        super().__init__()
        self.kind, self.local_fn = kind, local_fn
        self.fc = torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.fc(h)
        if self.kind == "ste":
            y = RoundSTE.apply(y)
        elif self.kind == "grl":
            y = GradReverse.apply(y, 0.5)
        elif self.kind == "two_outputs":
            a, b = TanhAndSquare.apply(y)
            y = a + 0.1 * b
        elif self.kind == "local":
            y = self.local_fn.apply(y)
        else:
            y = F.gelu(y)
        return h + y


class FunctionNet(torch.nn.Module):
    def __init__(self, kind: str, d: int = 32, layers: int = 4, classes: int = 8, local_fn=None):
        super().__init__()
        self.kind = kind
        self.inp = torch.nn.Linear(16, d)
        self.blocks = torch.nn.ModuleList(Block(d, kind, local_fn) for _ in range(layers))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        if self.kind == "fused_loss":
            return FusedCrossEntropy.apply(logits, labels)
        return F.cross_entropy(logits, labels)


def build(kind: str):
    local_fn = None
    if kind == "local":
        class LocalClamp(torch.autograd.Function):  # defined in a function: generated code cannot import it
            @staticmethod
            def forward(ctx, x):
                return x.clamp(-0.5, 0.5)

            @staticmethod
            def backward(ctx, g):
                return g * 0.25

        local_fn = LocalClamp
    model = FunctionNet(kind, local_fn=local_fn)
    batch = {"x": torch.randn(8, 16), "labels": torch.randint(0, 8, (8,))}
    return model, batch


KINDS = ["ste", "grl", "two_outputs", "fused_loss", "local"]
PLANS_2 = [("dp", {}, 2), ("tp", {}, 1), ("1f1b", {"pp": 2, "micro_batches": 2}, 1), ("zero3", {}, 2)]


def _all_kinds(rank, world, plans):
    import functools

    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in KINDS:
            for strategy, options, dp in plans:
                problems += sgd_equivalence(rank, world, functools.partial(build, kind), strategy, options, dp,
                                            what=f"{kind} under {strategy}")
    return problems


def test_functions_keep_their_backward_under_every_plan_2(workers2):
    problems = workers2.run(_all_kinds, PLANS_2)
    assert not any(problems), problems


def test_functions_keep_their_backward_hybrid_4(workers4):
    problems = workers4.run(_all_kinds, [("hybrid", {"tp": 2, "dp": 2}, 2)])
    assert not any(problems), problems


def test_function_is_one_op_calling_the_users_class():
    model, batch = build("ste")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = nns.capture(model, kwargs=batch, trace_repeated_layers_once=False)
    ops = [op for op in graph.ops if op.op_name.endswith("RoundSTE")]
    assert len(ops) == 4, [op.op_name for op in graph.ops]
    assert all(op.op_name == f"{__name__}.RoundSTE" for op in ops)
    assert not graph.find(target="aten.round.default")  # the forward's own ops are not in the graph
    assert "test_autograd_function.py" in ops[0].source
    plan = nns.plan(graph, strategy="dp", world_size=1)
    from nnscaler_plugins.codegen.generate import generate
    from nnscaler_plugins.lower.lowering import lower

    assert "RoundSTE.apply(" in generate(lower(graph, plan), 0)


def test_eager_gradients_are_the_users_even_on_one_process():
    """The bug this guards against: the STE's gradient came out zero (autograd of round)."""
    model, batch = build("ste")
    ref = FunctionNet("ste")
    ref.load_state_dict(model.state_dict())
    before = ref.inp.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, batch, plan="dp", cache_dir="/tmp/nns_test_cache")
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pm.train_step(batch)
    opt.step()
    ref(**batch).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    after = pm.full_state_dict()["inp.weight"]
    assert not torch.equal(after, before)  # the first layer learns through the STE
    assert torch.allclose(after, ref.inp.weight, rtol=1e-5, atol=1e-7)


class InPlaceScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class ReturnsNumber(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return 2 * g


class _Calls(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.fn.apply(self.fc(x))
        return (out[0] if isinstance(out, tuple) else out).sum()


@pytest.mark.parametrize("fn,words", [(InPlaceScale, "in place"), (ReturnsNumber, "must return tensors only")])
def test_functions_that_cannot_be_kept_whole_are_refused_by_name(fn, words):
    with pytest.raises(CaptureError) as e:
        nns.capture(_Calls(fn), (torch.randn(2, 4),))
    assert fn.__name__ in str(e.value) and words in str(e.value)


class _ElementwiseSTE:
    @hookimpl
    def nnscaler_register_op_rules(self):
        from nnscaler_plugins.rules.elementwise import elementwise

        return {RoundSTE: elementwise}


def split_functions(builder, **_):
    """A user plan: every RoundSTE split along its rows over the unit, everything else replicated."""
    from nnscaler_plugins import op_assign, op_trans

    for op in builder.ops:
        labels = op.signature.outputs[0] if op.signature.outputs else None
        if op.node.op_name.endswith("RoundSTE") and labels and op.splittable(labels[0], builder.unit_size):
            for device, sub in enumerate(op_trans(op, dim=labels[0], num=builder.unit_size)):
                op_assign(sub, device)
        else:
            builder.replicate(op)


def _split_by_rule(rank, world):
    import functools

    from nnscaler_plugins import plugins
    from nnscaler_plugins.rules import refresh

    plugin = _ElementwiseSTE()
    plugins.register(plugin)
    refresh()
    try:
        model, batch = build("ste")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = nns.plan(model, strategy=split_functions, world_size=world, example_inputs=batch)
            split = [name for name, p in plan.ops.items() if name.startswith("round_ste") and p.splits]
            problems = sgd_equivalence(rank, world, functools.partial(build, "ste"), plan, {}, 1,
                                       what="ste split by its registered rule")
    finally:
        plugins.unregister(plugin)
        refresh()
    return split, problems


def test_a_registered_rule_lets_a_plan_split_the_function(workers2):
    results = workers2.run(_split_by_rule)
    split, _ = results[0]
    assert len(split) == 4, "the plan could not split RoundSTE although a rule was registered for it"
    assert not any(p for _, p in results), results


def test_without_a_rule_the_function_is_replicate_only():
    """Unless its forward and backward are elementwise ops only (RoundSTE's are), which gives it the
    elementwise rule read from its code (rules/user_functions.py)."""
    model, batch = build("ste")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = nns.plan(model, strategy=split_functions, world_size=2, example_inputs=batch)
        fused, fused_batch = build("fused_loss")
        whole = nns.plan(fused, strategy="tp", world_size=2, example_inputs=fused_batch)
    assert all(p.splits for name, p in plan.ops.items() if name.startswith("round_ste"))
    assert all(not p.splits for name, p in whole.ops.items() if name.startswith("fused_cross_entropy"))
    assert any(name.startswith("fused_cross_entropy") for name in whole.ops)
