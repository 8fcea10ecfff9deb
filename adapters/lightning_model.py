"""What the LightningModule's inner model is replaced by under the "nnscaler" strategy.

`PlannedModel` holds the ParallelModule (so `configure_optimizers` sees this rank's shards through
`self.parameters()`) and answers the calls `training_step` makes. `Recorder` stands in for the model
once, before planning, to learn what `training_step` passes it.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

#: torch modules that compute differently in training and in evaluation.
_MODE_DEPENDENT = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._NormBase, torch.nn.RNNBase,
                   torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


def mode_dependent_modules(model: torch.nn.Module) -> list[str]:
    """The submodules whose forward differs between `train()` and `eval()`: torch's own (dropout with
    p > 0, batch/instance norm with running statistics, ...) and any whose class's forward reads
    `self.training`. A program captured in training mode runs their training behaviour, so an
    evaluation forward of such a model cannot run it."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, _MODE_DEPENDENT):
            p = getattr(m, "p", getattr(m, "dropout", 1.0))
            if isinstance(m, torch.nn.modules.batchnorm._NormBase):
                if m.track_running_stats:
                    found.append(name or type(m).__name__)
            elif not isinstance(p, (int, float)) or p > 0:
                found.append(name or type(m).__name__)
            continue
        if type(m).__module__.startswith("torch.nn."):
            continue
        try:
            source = inspect.getsource(type(m).forward)
        except (OSError, TypeError):
            continue
        if "training" in source:
            found.append(name or type(m).__name__)
    return found


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
    """`skeleton`: the planned model's structure on the meta device (`capture.skeleton.meta_skeleton`),
    `buffers`: its non-persistent buffers (not in any state dict); together with the whole weights
    they make the plain model a pickle of this one becomes (see `__reduce__`)."""

    def __init__(self, pmodule: torch.nn.Module, *, whole_steps: bool, skeleton: Optional[torch.nn.Module] = None,
                 buffers: Optional[dict[str, torch.Tensor]] = None, eval_refusal: str = ""):
        super().__init__()
        self.pmodule = pmodule
        self.whole_steps = whole_steps
        self.eval_refusal = eval_refusal  # why an evaluation forward cannot run ("" when it can)
        # plain attributes, not submodules: the skeleton's meta tensors are no part of this module's state
        self.__dict__["_skeleton"] = skeleton
        self.__dict__["_plain_buffers"] = dict(buffers or {})

    def __getattr__(self, name: str) -> Any:
        """Attributes of the plain model read through (`self.layer.weight`, `self.layer[0].bias` in a
        training_step or a callback): a parameter is this rank's piece of it, a submodule a view."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
            found = _read_through(self, name)
            if found is None:
                raise
            return found

    def __getitem__(self, index: int) -> Any:
        """`self.layer[0]` of a planned `nn.Sequential` / `ModuleList`: a view of that submodule."""
        found = _read_through(self, str(index))
        if found is None:
            raise IndexError(f"the planned model has no submodule {index!r}")
        return found

    def plain_model(self) -> torch.nn.Module:
        """The planned model as an ordinary module on the CPU with whole weights: what it pickles to.
        Collective where the weights are split (tensor-parallel pieces, ZeRO-3 chunks): call it, or
        pickle the LightningModule, on every rank, as Lightning's checkpointing does."""
        skeleton = self.__dict__.get("_skeleton")
        if skeleton is None:
            raise TypeError("this planned model cannot be pickled: its structure could not be copied when it was "
                            "planned (an attribute refuses deepcopy); save trainer.save_checkpoint(...) or "
                            "trainer.lightning_module.state_dict() instead")
        import copy

        model = copy.deepcopy(skeleton).to_empty(device="cpu")
        whole = self.pmodule.full_state_dict()
        missing, unexpected = model.load_state_dict(whole, strict=False)
        for name, value in self.__dict__["_plain_buffers"].items():  # not in any state dict: kept as planned
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, value.clone(), persistent=False)
        if missing or unexpected:
            raise RuntimeError(f"the planned model's whole weights do not fill its structure (missing {missing[:8]}, "
                               f"unexpected {unexpected[:8]})")
        model.train(self.training)
        return model

    def __reduce__(self) -> Any:
        """A pickle (`pickle.dumps(trainer.lightning_module)`, `torch.save(module)`) holds the plain model
        with whole weights, no process group, thread or generated code: loading it gives a module that
        runs eagerly in one process, as a DDP-trained LightningModule does."""
        return _plain, (self.plain_model(),)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.eval_refusal and not self.training:
            raise RuntimeError(self.eval_refusal)
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


class PlannedView:
    """A submodule of the planned model, read through by name: its parameters are this rank's pieces
    (tensor-parallel pieces, a ZeRO-3 chunk), its submodules views again."""

    def __init__(self, planned: PlannedModel, prefix: str) -> None:
        self._planned, self._prefix = planned, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        found = _read_through(self._planned, self._prefix + name)
        if found is None:
            raise AttributeError(f"the planned model has no {self._prefix + name!r}")
        return found

    def __getitem__(self, index: int) -> Any:
        return self.__getattr__(str(index))


def _read_through(planned: PlannedModel, fqn: str) -> Any:
    """What the plain model's `fqn` is in the planned one (None: nothing of that name)."""
    skeleton = planned.__dict__.get("_skeleton")
    if skeleton is None:
        return None
    if fqn in dict(skeleton.named_parameters(remove_duplicate=False)):
        return planned.pmodule.parameter(fqn)
    try:
        skeleton.get_submodule(fqn)
    except AttributeError:
        return None
    return PlannedView(planned, fqn + ".")


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """What a pickled `PlannedModel` loads as: the plain model itself."""
    return model
