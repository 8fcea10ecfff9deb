"""How a Hugging Face model's loss uses the Trainer's `num_items_in_batch`, found by running it once.

The plain Trainer passes its count of the accumulation window's label tokens to every model whose
forward takes `**kwargs`, and then counts the returned loss as already scaled for accumulation. A
model whose loss divides its summed token losses by that count (transformers' causal LM losses)
gives the window's mean; one whose head takes `**kwargs` but ignores the count (BERT's and T5's
heads compute a plain mean) makes the Trainer step with the sum of the window's batch means. The
planned program is captured without the count, as each batch's mean over its targets, so the
adapter must know which of the two the model does to weigh the batches of a window as the plain
Trainer does; nothing in a forward's signature says it, so the model is asked.
"""
from __future__ import annotations

import contextlib
import warnings
from enum import Enum
from typing import Any, Iterator, Mapping

import torch

from nnscaler_plugins.outputs import extract_loss


class CountUse(Enum):
    """What a model's loss does with `num_items_in_batch`."""
    DIVIDES = "divides"    # loss = (summed losses) / num_items_in_batch
    IGNORES = "ignores"    # the loss is the same whatever the count
    READS = "reads"        # on the meta device (no values) the count reaches the loss: read as DIVIDES,
                           # the way of transformers' own losses
    UNKNOWN = "unknown"    # the model did not run on the meta device, or returned no loss: read as DIVIDES


class LossCountError(ValueError):
    """The model's loss uses `num_items_in_batch` in a way the planned step cannot reproduce."""


def count_use(model: torch.nn.Module, batch: Mapping[str, Any]) -> CountUse:
    """Run `model(**batch, num_items_in_batch=c)` once, in eval mode, without weight gradients and
    with the random streams restored afterwards, and read how the loss depends on `c`: not at all
    (IGNORES), as `S / c` (DIVIDES: d loss / d c = -loss / c), or otherwise (refused with
    `LossCountError`, naming the model class). `batch` holds the labels, as the Trainer passes it.
    A model on the meta device runs on a meta copy of the batch: whether the count reaches the loss
    is known (IGNORES or READS), not how; one that does not run there gives UNKNOWN."""
    name = model_name(model)
    labels = batch.get("labels")
    items = float(labels.ne(-100).sum()) if isinstance(labels, torch.Tensor) else 1.0
    device = _device_of(model)
    on_meta = device.type == "meta"
    count = torch.tensor(max(items, 1.0), dtype=torch.float32, device="cpu" if on_meta else device,
                         requires_grad=True)
    if on_meta:  # shapes only: the batch goes to the meta device with the weights
        batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with _probing(model, device):
        try:
            loss = extract_loss(model(**batch, num_items_in_batch=count))
        except Exception:  # noqa: BLE001 - a meta-device model may not run eagerly; capture decides then
            if on_meta:
                return CountUse.UNKNOWN
            raise
        if not isinstance(loss, torch.Tensor):  # no loss to read: the Trainer's own checks say so
            return CountUse.UNKNOWN
        if not loss.requires_grad:  # nothing that needs a gradient reached the loss: the count did not
            return CountUse.IGNORES
        if on_meta or loss.device.type == "meta":
            return CountUse.READS
        (grad,) = torch.autograd.grad(loss, count, allow_unused=True)
    if grad is None:
        return CountUse.IGNORES
    value, slope, at = float(loss.detach()), float(grad), float(count.detach())
    if value == 0.0 or abs(slope * at / value + 1.0) <= 1e-3:
        return CountUse.DIVIDES
    raise LossCountError(
        f"{name}: its loss depends on num_items_in_batch other than as a sum divided by it (loss {value:.6g} at "
        f"num_items_in_batch={at:g}, d loss/d count = {slope:.6g}; a divided sum has {-value / at:.6g}), "
        "which the planned step (each batch's mean over its targets, weighed over the window) cannot reproduce. "
        "Divide the summed loss by num_items_in_batch, or set model.accepts_loss_kwargs = False before building "
        "the trainer so that the Trainer passes no count")


def warn_ignored(model: torch.nn.Module, accumulation: int) -> None:
    """The once-per-trainer warning for a model whose loss ignores the count the Trainer passes it."""
    warnings.warn(
        f"{model_name(model)}'s loss ignores num_items_in_batch, which the Trainer passes it (its forward takes "
        "**kwargs) and then counts as already scaled for gradient accumulation: as with a plain Trainer, each "
        f"batch's mean loss counts whole, so with gradient_accumulation_steps={accumulation} the step's gradient and "
        "logged loss are the sum of the window's batch means, not their mean (a plain Trainer over several "
        "processes also multiplies them by the process count; this trainer computes what one process does on the "
        "same global batch). Set model.accepts_loss_kwargs = False before building the trainer for the mean of the "
        "means, or have the loss divide its sum by num_items_in_batch for the window's mean",
        UserWarning, stacklevel=3)


def warn_unknown(model: torch.nn.Module, accumulation: int,
                 why: str = "running it could not tell: on the meta device its forward needs values, or it "
                            "returned no loss") -> None:
    """The warning for a model whose use of the count could not be read, under accumulation."""
    warnings.warn(
        f"cannot tell whether {model_name(model)}'s loss divides by num_items_in_batch ({why}); with "
        f"gradient_accumulation_steps={accumulation} the step is weighed as for a loss that does (the window's "
        "mean, as transformers' own causal LM losses give). If its loss ignores the count, a plain Trainer steps "
        "with the sum of the window's batch means instead: set model.accepts_loss_kwargs = False before building "
        "the trainer (both then take the mean of the means), or build the model on a real device",
        UserWarning, stacklevel=3)


def model_name(model: torch.nn.Module) -> str:
    """The model's class name, a PEFT model's base model's (whose head computes the loss)."""
    base = getattr(model, "get_base_model", None)
    return type(base() if callable(base) else model).__name__


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _probing(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Eval mode (no dropout draws), weights not needing gradients (only the count's path is
    recorded), every random stream the model could touch restored on exit; all put back after."""
    training = model.training
    frozen = [p for p in model.parameters() if p.requires_grad]
    devices = [device] if device.type == "cuda" else []
    try:
        for p in frozen:
            p.requires_grad_(False)
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.train(training)
