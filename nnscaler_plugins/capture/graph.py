"""The captured program: ops over named values, with shapes, dtypes and where each op came from.

The graph is the single source of truth every later stage reads (rules, plans, lowering, codegen).
It is plain data: no torch.fx objects leak out of `capture`, so a plan can be checked against a
graph without re-tracing and the graph can be fingerprinted for the code cache.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def describe(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}"


@dataclass(frozen=True)
class Ref:
    """A reference to a graph value inside an op's args (tensor or symbolic)."""

    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass
class Value:
    """A named value: a parameter, buffer, user input, constant, or op output."""

    name: str
    kind: str  # "param" | "buffer" | "input" | "constant" | "op"
    meta: Optional[TensorMeta]
    fqn: Optional[str] = None  # parameters and buffers: fully-qualified name in the model
    aliases: tuple[str, ...] = ()  # other FQNs of the same tensor (tied weights)
    producer: Optional[str] = None  # op name for kind == "op"
    persistent: bool = True  # buffers: False when the model keeps it out of its state dict


@dataclass
class OpNode:
    name: str
    target: Any  # an aten OpOverload (or other callable) called with args/kwargs
    args: tuple
    kwargs: dict
    inputs: list[str]  # tensor inputs, in the order they appear in (args, kwargs)
    outputs: list[Optional[str]]  # one name per tensor output; None for an unused element
    multi_output: bool  # the op returns a tuple/list (outputs index it)
    module_path: str = ""
    module_type: str = ""
    source: str = ""  # "file.py:123"
    source_code: str = ""  # the line itself, stripped
    grad_enabled: bool = True

    @property
    def op_name(self) -> str:
        t = self.target
        if isinstance(t, torch._ops.OpOverload):
            return str(t)  # "aten.linear.default", the key the rule table uses
        return getattr(t, "__name__", None) or str(t)

    @property
    def short_name(self) -> str:
        """The op's packet name without namespace or overload: 'aten.linear.default' -> 'linear'."""
        parts = self.op_name.split(".")
        return parts[1] if len(parts) == 3 else parts[-1]

    def where(self) -> str:
        """Human-readable location used in every error and warning about this op."""
        loc = self.source or "<unknown source>"
        mod = f" in {self.module_path}" if self.module_path else ""
        return f"{self.name} ({self.op_name}){mod} at {loc}"


def _without_devices(x: Any) -> Any:
    if isinstance(x, torch.device):
        return "<device>"
    if isinstance(x, (list, tuple)):
        return type(x)(_without_devices(v) for v in x)
    if isinstance(x, dict):
        return {k: _without_devices(v) for k, v in x.items()}
    return x


@dataclass
class InputSpec:
    name: str  # graph value name
    path: tuple  # ("args", i) or ("kwargs", key)


@dataclass
class Graph:
    ops: list[OpNode]
    values: dict[str, Value]
    inputs: list[InputSpec]
    outputs: list[Optional[str]]  # flattened model outputs (value names; None for non-tensor leaves)
    output_constants: list[Any]  # for None entries in outputs: the constant value
    out_spec: Any = None  # pytree spec to rebuild the model's output structure
    model_class: str = ""
    source_hash: str = ""  # hash of the model's Python source (code cache key)
    constants: dict[str, Any] = field(default_factory=dict, repr=False)  # lifted tensor constants by fqn
    # How a stack of repeated layers was traced: "" (no stack, or traced whole by request), "two layers"
    # (two traced, the rest copied), or "whole: <why two layers were not enough>". Not in the fingerprints:
    # both ways give the same program, under other op names (see Session.capture's agreement).
    traced: str = field(default="", compare=False)
    # The value reads capture answered on tensors made from sizes alone (capture/shape_values.py), in
    # the order the model made them: the model's line and the answer, for messages and explain (those
    # of the two layers traced when a stack of layers was traced two deep).
    folded: tuple = field(default=(), compare=False)
    # The example's plain settings among the forward's top-level inputs (a flag, a number, a string,
    # None) by input path: the program holds them as constants, so a call giving others is not its to
    # run (batches.ForwardArguments.unlike_example).
    settings: dict = field(default_factory=dict, compare=False)
    _by_name: dict[str, OpNode] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {op.name: op for op in self.ops}

    # -- lookups --------------------------------------------------------------------------
    def op(self, name: str) -> OpNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no op named {name!r} in the graph of {self.model_class}") from None

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def parameters(self) -> dict[str, Value]:
        """Parameters by fully-qualified name (tied weights appear under each of their names)."""
        out: dict[str, Value] = {}
        for v in self.values.values():
            if v.kind == "param":
                out[v.fqn] = v
                for a in v.aliases:
                    out[a] = v
        return out

    @property
    def buffers(self) -> dict[str, Value]:
        return {v.fqn: v for v in self.values.values() if v.kind == "buffer"}

    def consumers(self, value: str) -> list[OpNode]:
        return [op for op in self.ops if value in op.inputs]

    def find(self, *, target: Any = None, module: Optional[str] = None) -> list[OpNode]:
        """Ops whose aten overload (or its packet name) and/or module path prefix match."""
        out = []
        for op in self.ops:
            if target is not None:
                names = {op.op_name, op.short_name, ".".join(op.op_name.split(".")[:2])}
                if target is not op.target and str(target) not in names and target not in names:
                    continue
            if module is not None and not (op.module_path == module or op.module_path.startswith(module + ".")):
                continue
            out.append(op)
        return out

    # -- identity -------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Stable hash of the graph structure: ops, args, shapes, dtypes and parameter names.

        Two captures of the same model code with the same input shapes hash equal; any change
        that could change the generated program changes the hash.
        """
        h = hashlib.sha256()
        for v in sorted(self.values.values(), key=lambda v: v.name):
            h.update(f"{v.name}|{v.kind}|{v.fqn}|{v.aliases}|{v.meta}\n".encode())
        for op in self.ops:
            # Devices are left out: generated code runs on the module's device whatever the capture
            # saw, and a plan made on a meta-device capture must fit the real model's graph.
            args, kwargs = _without_devices(op.args), _without_devices(op.kwargs)
            h.update(f"{op.name}|{op.op_name}|{args!r}|{sorted(kwargs.items())!r}|{op.outputs}|{op.grad_enabled}\n".encode())
        h.update(repr([i.path for i in self.inputs]).encode())
        h.update(repr(self.outputs).encode())
        return h.hexdigest()[:16]

    def structure_fingerprint(self) -> str:
        """The fingerprint with every size that follows the inputs' left out: the ops, their non-integer
        arguments, dtypes and ranks, and the parameters' and buffers' whole shapes. Graphs of one model
        captured at other batch sizes or lengths share it, so a plan made at one length serves
        another (the runtime fits the sizes; validation checks the plan's splits against them)."""
        def shapeless(x: Any) -> Any:
            if isinstance(x, bool) or not isinstance(x, int):
                if isinstance(x, (list, tuple)):
                    return type(x)(shapeless(a) for a in x)
                if isinstance(x, dict):
                    return {k: shapeless(v) for k, v in x.items()}
                return x
            return "#"

        h = hashlib.sha256()
        for v in sorted(self.values.values(), key=lambda v: v.name):
            m = v.meta
            meta = m if v.kind in ("param", "buffer", "constant") or m is None else (m.dtype, m.ndim, m.requires_grad)
            h.update(f"{v.name}|{v.kind}|{v.fqn}|{v.aliases}|{meta}\n".encode())
        for op in self.ops:
            args, kwargs = shapeless(_without_devices(op.args)), shapeless(_without_devices(op.kwargs))
            h.update(f"{op.name}|{op.op_name}|{args!r}|{sorted(kwargs.items())!r}|{op.outputs}|{op.grad_enabled}\n".encode())
        h.update(repr([i.path for i in self.inputs]).encode())
        h.update(repr(self.outputs).encode())
        return h.hexdigest()[:16]

    def summary(self) -> str:
        n_params = sum(v.meta.numel for v in self.values.values() if v.kind == "param" and v.meta)
        return (f"Graph({self.model_class}: {len(self.ops)} ops, "
                f"{sum(1 for v in self.values.values() if v.kind == 'param')} parameters "
                f"({n_params / 1e6:.2f} M elements), inputs {[i.name for i in self.inputs]})")

    def meta(self, value: str) -> TensorMeta:
        m = self.values[value].meta
        if m is None:
            raise TypeError(f"value {value!r} is not a tensor")
        return m
