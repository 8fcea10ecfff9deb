"""The loss a framework back-propagates itself, weighed so that replicas average to one device's loss.

Lightning and DeepSpeed scripts call the model, take its loss and run backward; gradients are then
averaged over data-parallel replicas, which gives one device's gradients only when every replica's
loss is the mean of as many items. With per-batch padding or a last smaller batch it is not: each
replica's loss is multiplied by `ParallelModule.loss_weight` (its share of the step's items, times
the replicas) in the model's output, so the gradients, and the loss averaged over replicas (what
Lightning's `sync_dist=True` logs), are those of one device on every replica's batch together.
"""
from __future__ import annotations

from typing import Any


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
    """The output with its loss (as `runtime.loss.extract_loss` finds it) multiplied by `weight`."""
    if hasattr(output, "loss") and not isinstance(output, dict):
        output.loss = output.loss * weight
        return output
    if isinstance(output, dict):  # Hugging Face ModelOutputs are dicts whose items are their attributes
        if "loss" not in output:
            raise TypeError(f"the model returned a dict without 'loss' (keys: {sorted(output)})")
        output["loss"] = output["loss"] * weight
        return output
    if isinstance(output, (tuple, list)) and output:
        return type(output)([output[0] * weight, *output[1:]])
    return output * weight
