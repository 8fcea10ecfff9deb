"""How many items a micro-batch's loss is the mean of, so pieces of a batch weigh what they hold.

Data-parallel replicas and micro-batches each compute the mean loss of their piece. Averaging
those means equals the loss of the whole batch only when every piece holds as many items. With
padded text (labels of -100) or a last, smaller batch they do not, so each piece's loss is weighted
by its share of the items of the whole step, as one device computing the batch's loss would.

The items are the targets the loss does not ignore when the model's loss is a mean-reduced
cross-entropy or NLL (the Hugging Face models' loss, and most hand-written ones): they are counted
by running the ops that make the target from the inputs (label shifting, padding, flattening),
which read no parameter. Any other loss is taken as a mean over the batch's samples (dim 0).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode, Ref

# Mean-reduced losses whose denominator is the number of targets not equal to ignore_index:
# op name -> (position of target, of weight, of reduction, of ignore_index) in the positional args.
_MEAN_OVER_TARGETS = {
    "aten.cross_entropy_loss.default": (1, 2, 3, 4),
    "aten.nll_loss.default": (1, 2, 3, 4),
    "aten.nll_loss_nd.default": (1, 2, 3, 4),
    "aten.nll_loss2d.default": (1, 2, 3, 4),
}
_DEFAULTS = {2: None, 3: 1, 4: -100}  # weight, reduction (1 = mean), ignore_index
# A loss and an auxiliary term added to it.
_SUMS = {"aten.add.Tensor", "aten.add_.Tensor"}
# Ops between the loss and the model's loss output that leave the value as it is.
_PASS_THROUGH = {"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.clone.default",
                 "aten.alias.default", "aten.view.default", "aten.reshape.default"}


class LossItems:
    def __init__(self, graph: Graph, loss_index: Optional[int]):
        self.graph = graph
        self.target: Optional[str] = None
        self.ignore_index = -100
        self.ops: list[OpNode] = []
        self._warned = False
        if loss_index is None or graph.outputs[loss_index] is None:
            return
        op = self._main_term(self._producer(graph.outputs[loss_index]))
        if op is None or op.op_name not in _MEAN_OVER_TARGETS:
            return
        t, w, r, ig = _MEAN_OVER_TARGETS[op.op_name]
        arg = (lambda i, name: op.args[i] if len(op.args) > i else op.kwargs.get(name, _DEFAULTS[i]))
        if arg(w, "weight") is not None or arg(r, "reduction") != 1 or not isinstance(op.args[t], Ref):
            return
        ops = self._ancestors(op.args[t].name)
        if ops is None:
            return
        self.target, self.ignore_index, self.ops = op.args[t].name, int(arg(ig, "ignore_index")), ops

    def _through(self, op: Optional[OpNode]) -> Optional[OpNode]:
        while op is not None and op.op_name in _PASS_THROUGH:
            op = self._producer(op.inputs[0]) if op.inputs else None
        return op

    def _main_term(self, op: Optional[OpNode]) -> Optional[OpNode]:
        """The loss op, also when an auxiliary term is added to it (a mixture-of-experts model's
        `loss + coef * router_loss`): of the two terms of the sum, the one that is a mean over
        targets, when the other reaches no such loss. Weighting the pieces by targets then weighs
        the auxiliary term by shares that add up to one, as the whole batch's loss does."""
        op = self._through(op)
        if op is None or op.op_name not in _SUMS or len(op.inputs) != 2:
            return op
        terms = [self._through(self._producer(v)) for v in op.inputs]
        means = [t for t in terms if t is not None and t.op_name in _MEAN_OVER_TARGETS]
        others = [v for v, t in zip(op.inputs, terms) if t not in means]
        if len(means) != 1 or len(others) != 1 or self._reaches_loss(others[0]):
            return op
        return means[0]

    def _reaches_loss(self, value: str) -> bool:
        """Whether a loss over targets takes part in making `value`."""
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            op = self._producer(v) if v not in seen else None
            seen.add(v)
            if op is None:
                continue
            if op.op_name in _MEAN_OVER_TARGETS or "loss" in op.op_name:
                return True
            stack.extend(op.inputs)
        return False

    @property
    def counts_targets(self) -> bool:
        """Whether items are counted targets (True) or samples."""
        return self.target is not None

    def _producer(self, value: str) -> Optional[OpNode]:
        v = self.graph.values.get(value)
        return self.graph.op(v.producer) if v is not None and v.kind == "op" and v.producer else None

    def _ancestors(self, value: str) -> Optional[list[OpNode]]:
        """The ops that make `value` from the inputs alone, in graph order (None if a parameter,
        buffer or random op takes part)."""
        need, stack, seen = set(), [value], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            val = self.graph.values[v]
            if val.kind in ("param", "buffer"):
                return None
            if val.kind == "op":
                op = self.graph.op(val.producer)
                if "rand" in op.op_name or "dropout" in op.op_name:
                    return None
                need.add(op.name)
                stack.extend(op.inputs)
        return [op for op in self.graph.ops if op.name in need]

    def count(self, flat: Sequence[Any]) -> int:
        """Items of one micro-batch, from its graph inputs (in `graph.inputs` order)."""
        if self.target is not None:
            try:
                return self._count_targets(flat)
            except Exception as e:  # noqa: BLE001 - counting is a weight, not the computation: say so and fall back
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"could not count the loss's targets ({type(e).__name__}: {e}); pieces of a batch "
                                  "are weighted by their samples instead", stacklevel=3)
                self.target = None
        return samples(flat)

    def _count_targets(self, flat: Sequence[Any]) -> int:
        env: dict[str, Any] = {}
        for spec, x in zip(self.graph.inputs, flat):
            env[spec.name] = x.detach().cpu() if isinstance(x, torch.Tensor) else x
        for name, v in self.graph.values.items():
            if v.kind == "constant" and v.fqn in self.graph.constants:
                env[name] = self.graph.constants[v.fqn]

        def resolve(a: Any) -> Any:
            if isinstance(a, Ref):
                return env[a.name]
            if isinstance(a, (list, tuple)):
                return type(a)(resolve(x) for x in a)
            if isinstance(a, dict):
                return {k: resolve(x) for k, x in a.items()}
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        with torch.no_grad():
            for op in self.ops:
                out = op.target(*resolve(op.args), **resolve(op.kwargs))
                outs = list(out) if op.multi_output else [out]
                for name, o in zip(op.outputs, outs):
                    if name is not None:
                        env[name] = o
        return int((env[self.target] != self.ignore_index).sum())


def samples(flat: Sequence[Any]) -> int:
    for x in flat:
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return int(x.shape[0])
    return 1
