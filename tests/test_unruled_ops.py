"""Ops without a dimension rule run replicated, and their neighbours still get exactly the
communication their gradients need.

A property test: ops the rule table does not know are inserted (as forward hooks, so capture
traces them into the graph) at randomly drawn places of small GPT-2 and Llama models, which are
then trained under dp, tp, hybrid, a 1F1B pipeline and ZeRO-3 and compared with one process.
The draws are seeded, so a failure names a case that can be run again.
"""
from __future__ import annotations

import functools
import random
import warnings

import pytest
import torch

import models
from nnscaler_plugins.rules import has_rule
from sgd_check import sgd_equivalence

# name -> (function of a float tensor giving one of the same shape, the aten ops it is made of)
RULE_LESS = {
    "fft": (lambda h: torch.fft.irfft(torch.fft.rfft(h, dim=-1) * 0.5, n=h.shape[-1], dim=-1),
            ["aten.fft_rfft.default", "aten.fft_irfft.default"]),
    "cummax": (lambda h: torch.cummax(h, dim=-1).values, ["aten.cummax.default"]),
    "logcumsumexp": (lambda h: torch.logcumsumexp(h, dim=1), ["aten.logcumsumexp.default"]),
    "flip": (lambda h: torch.flip(h, dims=[-1]), ["aten.flip.default"]),
    "i0e": (lambda h: torch.special.i0e(h), ["aten.special_i0e.default"]),
}


def rule_less() -> list[str]:
    """The entries still without a rule (a new rule turns its entry into an ordinary op)."""
    return [k for k, (_, ops) in RULE_LESS.items() if not any(has_rule(o) for o in ops)]


def _hook(fn_name: str):
    fn = RULE_LESS[fn_name][0]

    def hook(module, args, out):
        return fn(out)  # the only path from here on: no parallel float path can carry the gradient instead
    return hook


def _eligible(model: torch.nn.Module, batch: dict) -> list[str]:
    """Modules whose output is one float tensor with a batch and a sequence dim."""
    seen: dict[str, bool] = {}
    handles = []
    for name, m in model.named_modules():
        if not name:
            continue

        def record(mod, args, out, name=name):
            seen[name] = isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 3
        handles.append(m.register_forward_hook(record))
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return sorted(n for n, ok in seen.items() if ok)


def build(name: str, layers: int, picks: tuple[tuple[str, str], ...]):
    model, batch = getattr(models, name)(layers=layers)
    for module_name, fn_name in picks:
        model.get_submodule(module_name).register_forward_hook(_hook(fn_name))
    return model, batch


def draw(name: str, layers: int, seed: int) -> tuple[tuple[str, str], ...]:
    """Two places: one anywhere, and one at a norm's output, which feeds the ops tensor parallelism
    splits first (a column-split matmul consuming a whole input needs its input gradient summed)."""
    torch.manual_seed(0)
    model, batch = getattr(models, name)(layers=layers)
    rng = random.Random(seed)
    places = _eligible(model, batch)
    norms = [p for p in places if "ln" in p.rsplit(".", 1)[-1] or "norm" in p.rsplit(".", 1)[-1]]
    first = rng.choice(norms)
    second = rng.choice([p for p in places if p != first])
    return tuple((p, rng.choice(rule_less())) for p in (first, second))


CASES_2 = [  # (model, layers, strategy, options, dp, seed)
    ("gpt2_small", 4, "dp", {}, 2, 1),
    ("gpt2_small", 4, "tp", {}, 1, 2),
    ("llama_small", 4, "tp", {}, 1, 3),
    ("gpt2_small", 2, "tp", {}, 1, 4),
    ("llama_small", 4, "1f1b", {"pp": 2, "micro_batches": 2}, 1, 5),
    ("gpt2_small", 4, "zero3", {}, 2, 6),
    ("llama_small", 2, "megatron", {"tp": 2, "sequence_parallel": True}, 1, 7),
]
CASES_4 = [
    ("gpt2_small", 4, "hybrid", {"tp": 2, "dp": 2}, 2, 8),
    ("llama_small", 4, "hybrid", {"tp": 2, "dp": 2}, 2, 9),
]


def _run(rank, world, cases):
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, layers, strategy, options, dp, seed in cases:
            picks = draw(name, layers, seed)
            problems += sgd_equivalence(rank, world, functools.partial(build, name, layers, picks), strategy, options,
                                        dp, what=f"{name} x{layers} {strategy} seed {seed} with {picks}")
    return problems


def test_rule_less_entries_exist():
    assert len(rule_less()) >= 2, "pick other rule-less ops for this test: the table now knows these"


def test_rule_less_ops_between_split_ops_2(workers2):
    problems = workers2.run(_run, CASES_2)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def test_rule_less_ops_between_split_ops_4(workers4):
    problems = workers4.run(_run, CASES_4)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


@pytest.mark.parametrize("fn_name", sorted(RULE_LESS))
def test_each_rule_less_op_is_captured_without_a_rule(fn_name):
    import nnscaler_plugins as nns
    from nnscaler_plugins.rules import unruled_ops

    if fn_name not in rule_less():
        pytest.skip(f"{fn_name} has a rule now")
    model, batch = build("gpt2_small", 2, (("transformer.h.0.mlp", fn_name),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = nns.capture(model, kwargs=batch)
    names = {op.op_name for op in unruled_ops(graph)}
    assert names & set(RULE_LESS[fn_name][1]), names
