"""Mixture-of-experts layers captured as one op, so a plan can move tokens to their experts.

Why one op: what a MoE layer computes per token is `sum_k w[t, k] * expert_{i[t, k]}(x[t])`, but
transformers writes it in several forms (a Python loop over the experts that were hit, grouped
matmuls behind `histc`/`index_put`, batched matmuls), all driven by data-dependent routing. None of
those forms can be split so that each device holds only its experts *and* sees only the tokens
routed to them: that needs the tokens moved by all-to-all, with sizes known at run time. Seen as one
op `experts(x, top_k_index, top_k_weights, *stacked weights)`, the same computation has a plain
dimension rule (`rules/experts_op.py`) whose expert split runs the dispatching kernel of
`kernels/expert_dispatch.py`.

What is recognized, by structure and not by class name: a module whose parameters are all stacked
along a leading dim of `E` experts (`E` equal to its `num_experts` attribute), called with a token
matrix `(T, H)`, integer expert ids `(T, K)` and routing weights `(T, K)`, returning `(T, H)`. This
is the `...Experts` module of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and other transformers 5
models, whichever experts implementation the config selects.

Only a strategy that asks for it (`experts_as_one_op`) captures this way; other plans keep the
expert ops as transformers wrote them (their grouped matmuls have rules of their own).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from nnscaler_plugins.capture.autograd_functions import opaque_call
from nnscaler_plugins.kernels.experts_module import ExpertsCall, register_template

def stacked_parameters(module: torch.nn.Module) -> Optional[list[tuple[str, torch.nn.Parameter]]]:
    """The module's parameters when they are all stacked along one leading expert dim equal to its
    `num_experts`, else None."""
    e = getattr(module, "num_experts", None)
    params = list(module.named_parameters())
    if not isinstance(e, int) or e < 1 or not params:
        return None
    if any(p.ndim < 2 or p.shape[0] != e for _, p in params):
        return None
    return params


def is_experts_call(args: tuple, kwargs: dict) -> bool:
    """The call pattern of a stacked-experts module: (tokens (T, H), ids (T, K), weights (T, K))."""
    if kwargs or len(args) != 3 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    x, ids, w = args
    return (x.ndim == 2 and ids.ndim == 2 and w.ndim == 2 and x.is_floating_point()
            and not ids.is_floating_point() and w.is_floating_point()
            and ids.shape == w.shape and ids.shape[0] == x.shape[0])


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[list[str]]:
    """While active, every stacked-experts module of `model` records one `ExpertsCall` op when it is
    called the experts way (inside `capture`, which keeps such Functions whole). Yields the module
    paths that were found."""
    found: list[str] = []
    patched: list[torch.nn.Module] = []
    for path, module in model.named_modules():
        params = stacked_parameters(module)
        if params is None or "forward" in vars(module):
            continue
        names = tuple(n for n, _ in params)
        key = register_template(module)
        original = module.forward

        def forward(*args: Any, _orig=original, _mod=module, _key=key, _names=names, **kwargs: Any) -> Any:
            if not is_experts_call(args, kwargs):
                return _orig(*args, **kwargs)
            x, ids, w = args
            tensors = tuple(p for _, p in _mod.named_parameters())
            return opaque_call(ExpertsCall, (x, ids, w, _key, _names) + tensors, {})

        module.forward = forward
        patched.append(module)
        found.append(path)
    try:
        yield found
    finally:
        for module in patched:
            del module.forward


def wants_experts_as_one_op(strategy_or_plan: Any) -> bool:
    """Whether a strategy (attribute `experts_as_one_op`) or a plan it made (its knob
    `experts_as_one_op`) needs the experts captured as one op."""
    if getattr(strategy_or_plan, "experts_as_one_op", False) or \
            getattr(getattr(strategy_or_plan, "apply", None), "experts_as_one_op", False):
        return True
    return bool(getattr(getattr(strategy_or_plan, "knobs", None), "experts_as_one_op", False))
