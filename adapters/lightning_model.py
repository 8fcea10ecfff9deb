"""What the LightningModule's inner model is replaced by under the "nnscaler" strategy.

`PlannedModel` holds the ParallelModule (so `configure_optimizers` sees this rank's shards through
`self.parameters()`) and answers the calls `training_step` makes. `Recorder` stands in for the model
once, before planning, to learn what `training_step` passes it.
"""
from __future__ import annotations

from typing import Any

import torch


class Recorded(Exception):
    """Raised by `Recorder` to stop `training_step` at the model call, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("inputs recorded")
        self.args, self.kwargs = args, kwargs


class Recorder(torch.nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise Recorded(args, kwargs)


class StepOutput(dict):
    """The result of a whole training step run inside the model call: only the loss exists.

    `out.loss`, `out["loss"]` and `out[0]` give it. The tensor requires grad so that Lightning's
    automatic backward runs, but it is a leaf: the real backward already happened in the step.
    """

    def __init__(self, loss: torch.Tensor):
        super().__init__(loss=loss)

    @property
    def loss(self) -> torch.Tensor:
        return self["loss"]

    def __getitem__(self, key: Any) -> Any:
        if key == 0:
            key = "loss"
        if key != "loss":
            raise KeyError(f"{key!r}: under a plan that runs whole training steps (a pipeline or micro-batches) the "
                           "model call returns only the loss; compute the loss inside the model (e.g. pass labels)")
        return super().__getitem__(key)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{name!r}: under a plan that runs whole training steps (a pipeline or micro-batches) "
                             "the model call returns only the loss; compute the loss inside the model")


class _DeferredGradients(torch.autograd.Function):
    """The loss of a step whose gradients were already computed: its backward adds them, scaled by
    the incoming gradient (Lightning divides the loss by the accumulation count, a precision plugin
    may scale it), to the parameters' `.grad`. Lightning zeroes gradients between `training_step`
    and backward, so gradients made inside the model call must wait for that backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, loss: torch.Tensor, pending: Any) -> torch.Tensor:
        ctx.pending = pending
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        scale = grad.detach()
        with torch.no_grad():
            for p, g in ctx.pending:
                g = g * scale.to(g.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        ctx.pending = None
        return None, None, None


class PlannedModel(torch.nn.Module):
    def __init__(self, pmodule: torch.nn.Module, *, whole_steps: bool):
        super().__init__()
        self.pmodule = pmodule
        self.whole_steps = whole_steps

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.whole_steps:
            if self.training and torch.is_grad_enabled():  # Lightning runs backward on this loss itself
                from .loss_weight import weighed_output

                return weighed_output(self.pmodule, args, kwargs, lambda: self.pmodule(*args, **kwargs))
            return self.pmodule(*args, **kwargs)
        if not (self.training and torch.is_grad_enabled()):
            raise RuntimeError("this plan runs whole training steps (a pipeline or micro-batches); evaluation "
                               "outside training_step is not supported with it: validate with a plan without "
                               "pipeline stages or micro-batches")
        if args and kwargs:
            raise TypeError("call the model with positional or keyword arguments, not both")
        batch = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        return StepOutput(self._step(batch))

    def _step(self, batch: Any) -> torch.Tensor:
        """Forward and backward now (gradients already averaged over replicas), kept aside until the
        returned loss is back-propagated."""
        params = [p for p in self.pmodule.parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.pmodule.train_step(batch)
        pending = [(p, p.grad) for p in params if p.grad is not None]
        for p, old in zip(params, before):
            p.grad = old
        anchor = torch.zeros((), device=loss.device, requires_grad=True)
        return _DeferredGradients.apply(anchor, loss, pending)
