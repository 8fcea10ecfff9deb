"""Backward in two parts, as zero-bubble schedules need: the input gradients first (the previous
stage waits for them), the weight gradients later (nobody waits for them).

PyTorch's pipelining package has the graph surgery that computes each part once; it is not a
public API, so it is used when present and the public fallback takes over otherwise: the input
part prunes the weight-gradient matmuls, and the weight part runs the backward again from the
stage outputs, restricted to the parameters (same values, some activation gradients computed
twice).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch


@functools.cache
def _pipelining_parts() -> tuple[Optional[Callable], Optional[Callable]]:
    """PyTorch's input-part and weight-part backward, or (None, None). Imported on first use:
    the pipelining package pulls in DTensor and costs every process about a second at import."""
    try:  # pragma: no cover - depends on the installed torch
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:  # pragma: no cover
        return None, None
    return stage_backward_input, stage_backward_weight


class SplitBackward:
    """One micro-batch of one stage: `inputs()` now, `weights()` later."""

    def __init__(self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
        self.roots = list(roots)
        self.grads = list(grads)
        self.leaves = [t for t in leaves if t.requires_grad]
        self.params = [p for p in params if isinstance(p, torch.nn.Parameter) and p.requires_grad]
        self._groups: Optional[Any] = None
        self._retained = False

    def inputs(self) -> None:
        """Gradients of the stage inputs, accumulated into their `.grad`."""
        if not self.roots:
            return
        if not self.leaves:
            return  # nothing upstream waits: the weight part does the whole backward
        input_part, _ = _pipelining_parts()
        if input_part is not None:
            _, self._groups = input_part(self.roots, self.grads, self.leaves, iter(self.params))
            return
        got = torch.autograd.grad(self.roots, self.leaves, self.grads, retain_graph=True, allow_unused=True)
        for leaf, g in zip(self.leaves, got):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
        self._retained = True

    def weights(self) -> None:
        """Gradients of the stage's parameters, accumulated into their `.grad`."""
        if not self.roots or not self.params:
            return
        if not self.leaves:
            torch.autograd.backward(self.roots, self.grads, inputs=self.params)
        elif self._groups is not None:
            _pipelining_parts()[1](iter(self.params), self._groups)
        else:
            torch.autograd.backward(self.roots, self.grads, inputs=self.params)
        self.roots = self.grads = []
        self._groups = None
