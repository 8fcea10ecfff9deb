"""A Trainer subclass's own `compute_loss`, run inside the planned training step.

Trainer subclasses (TRL's, or a user's) override `compute_loss` to log metrics read off the model's
outputs, or to change the inputs the model is called with. Under `NNScalerTrainerMixin` that
override still runs in every training step, calling the planned model (its forward, then a backward
this adapter runs), instead of being skipped for the plan's `train_step`. The plan's arithmetic stays
exact only for the loss the planned model itself returns: it is weighed by the replica's share of
the step's targets and by the batch's share of the accumulation window, which says nothing about a
loss computed elsewhere. So each forward call made with gradients is recorded with its weight, and
the loss `compute_loss` returns must be one of those outputs, untouched; anything else is refused,
naming the class, rather than trained with a wrong weight.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from nnscaler_plugins.outputs import extract_loss


class CustomLossError(NotImplementedError):
    """A subclass's `compute_loss` returned a loss the planned step cannot weigh exactly."""


def own_compute_loss(trainer_cls: type, skip: type) -> Optional[type]:
    """The class whose `compute_loss` a training step of `trainer_cls` runs first (the mixin `skip`
    left out); None when it is `transformers.Trainer`'s own, which the plan's `train_step` computes."""
    from transformers import Trainer

    for c in trainer_cls.__mro__:
        if c is skip:
            continue
        if "compute_loss" in c.__dict__:
            return None if c is Trainer else c
    return None


class ForwardCalls:
    """The planned model's forward calls with gradients during one training step: each call's loss
    output (and its in-place version counter) with the weight `ParallelModule.loss_weight` gave
    its batch before the call (collective: every rank makes the same calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, int, float]] = []

    def record(self, output: Any, weight: float) -> None:
        loss = extract_loss(output)
        if isinstance(loss, torch.Tensor):
            self.calls.append((loss, loss._version, weight))

    def weight_of(self, loss: Any, owner: str) -> float:
        """The weight of the call whose loss output `loss` is; refuses any other loss."""
        for found, version, weight in self.calls:
            if loss is found and loss._version == version:
                return weight
        what = ("made no forward call with gradients" if not self.calls else
                "returned a loss other than the planned model's own loss output (one it computed itself, "
                "or the model's changed in place)")
        raise CustomLossError(
            f"{owner}.compute_loss {what}: the planned step weighs the model's loss by each replica's share of the "
            "step's targets and each batch's share of the accumulation window, which it cannot do for another loss. "
            "Return the loss the model returns (metrics may still be computed from its outputs), or compute that "
            "loss in the model's forward")
