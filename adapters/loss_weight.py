"""The loss a framework back-propagates itself, weighed so that replicas average to one device's loss.

Lightning and DeepSpeed scripts call the model, take its loss and run backward; gradients are then
averaged over data-parallel replicas, which gives one device's gradients only when every replica's
loss is the mean of as many items. With per-batch padding or a last smaller batch it is not: each
replica's loss is multiplied by `ParallelModule.loss_weight` (its share of the step's items, times
the replicas) in the model's output, so the gradients, and the loss averaged over replicas (what
Lightning's `sync_dist=True` logs), are those of one device on every replica's batch together.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch


def weighed_output(pmodule: Any, args: tuple, kwargs: dict, call: Any) -> Any:
    """`call()`'s output (the model's forward on these inputs) with its loss weighed. Collective
    over every rank when data-parallel, and run before the forward, so a size the plan cannot take
    is refused on every rank before any of them starts it."""
    if pmodule.dp_size <= 1:
        return call()
    batch = kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args))
    weight = pmodule.loss_weight(batch)
    output = call()
    return output if weight == 1.0 else _with_loss(output, weight)


def _with_loss(output: Any, weight: float) -> Any:
    """The output with its loss (as `runtime.loss.extract_loss` finds it) multiplied by `weight`.
    Only a scalar is taken for the loss: anything else (logits the script turns into a loss itself)
    is left as it is, with a warning that replicas then average their own means, as DDP does."""
    if hasattr(output, "loss") and not isinstance(output, dict) and _scalar(output.loss):
        output.loss = output.loss * weight
        return output
    if isinstance(output, dict) and _scalar(output.get("loss")):  # Hugging Face ModelOutputs are dicts too
        output["loss"] = output["loss"] * weight
        return output
    if isinstance(output, (tuple, list)) and output and _scalar(output[0]):
        return type(output)([output[0] * weight, *output[1:]])
    if _scalar(output):
        return output * weight
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("the model's output holds no scalar loss (.loss, ['loss'], a tuple's first element or a "
                      "scalar), so replicas holding different numbers of items cannot be weighed: each replica's "
                      "loss counts alike, as under DDP. Return the loss from the model to train as one device would",
                      stacklevel=3)
    return output


_warned = False


def _scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim == 0
