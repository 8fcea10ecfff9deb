"""A model's graph without its computation: its parameters and buffers, by name, shape and dtype.

Plans that keep whole layers on every device (data parallelism, ZeRO 1-3, offload) decide nothing per
op: what they shard is the training state, and the model's own forward can run as it is, eagerly, on
every replica. When `torch.export` cannot capture a forward (data-dependent sizes, Python control flow
on values, `.item()`), such a plan is made from this graph instead: the same strategies, knobs, mesh,
shard specs, checkpoints and optimizer, with no op to place. The runtime then runs the user's module
itself (`runtime/eager_executor.py`).

Nothing here runs the model: the graph is read off its parameters and buffers, so it costs nothing
and moves no random stream.
"""
from __future__ import annotations

import torch

from nnscaler_plugins.capture.graph import Graph, TensorMeta, Value


def value_name(fqn: str) -> str:
    """The graph value of parameter or buffer `fqn` (a name generated code could use)."""
    return "p_" + fqn.replace(".", "_")


def parameter_graph(model: torch.nn.Module) -> Graph:
    """The graph of `model`'s parameters and buffers (tied ones once, under every name), no ops."""
    values: dict[str, Value] = {}
    by_tensor: dict[int, str] = {}
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for fqn, t in named:
            if t is None:
                continue
            seen = by_tensor.get(id(t))
            if seen is not None:  # a tied weight: one value, its other names as aliases
                v = values[seen]
                values[seen] = Value(v.name, v.kind, v.meta, v.fqn, v.aliases + (fqn,), persistent=v.persistent)
                continue
            name = value_name(fqn)
            by_tensor[id(t)] = name
            meta = TensorMeta(tuple(t.shape), t.dtype, bool(kind == "param" and t.requires_grad))
            values[name] = Value(name, kind, meta, fqn, persistent=kind == "param" or _persistent(model, fqn))
    return Graph(ops=[], values=values, inputs=[], outputs=[], output_constants=[],
                 model_class=type(model).__name__)


def _persistent(model: torch.nn.Module, fqn: str) -> bool:
    """Whether buffer `fqn` is in the model's state dict (not registered with persistent=False)."""
    owner, _, leaf = fqn.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in module._non_persistent_buffers_set
