"""Capture a deep stack of identical layers by tracing two of them.

torch.export spends a few milliseconds per op on a laptop core: a 32-layer Llama is about 1,800
ops and 7 s of tracing, most of it tracing the same layer again and again. When a model holds a
`ModuleList` of layers that are the same in every respect the planner can see (class, parameter
and buffer shapes, scalar attributes, per-layer config lists), the model is traced with only its
first two layers; the second layer's ops are checked to be the first's, op for op, with each
input either shared (the causal mask, rotary tables) or carried from the layer before (the hidden
state). The remaining layers are then written into the graph as copies of the first, with their
own parameters (`layers.2.*`, ...) and the carried values threaded through, and the ops after the
stack read the last layer's outputs. The result is the graph a full trace gives, up to value names.

Anything that does not fit this pattern (a layer that reads its index, ops between layers, a
layer output used later, a model that checks its layer count) falls back to tracing everything.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from nnscaler_plugins.capture.graph import Graph, OpNode, Ref, Value

# A stack shorter than this is traced whole: the saving would be small.
MIN_LAYERS = 4
# Attributes that legitimately differ between otherwise identical layers.
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "idx", "index", "block_idx"})
_SCALARS = (int, float, str, bool, type(None))


@dataclass
class Stack:
    path: str  # "model.layers"
    parent: torch.nn.Module
    attr: str
    modules: torch.nn.ModuleList

    @contextlib.contextmanager
    def truncated(self, keep: int = 2) -> Iterator[None]:
        """The model with only the first `keep` layers, for the duration of the trace."""
        short = torch.nn.ModuleList(list(self.modules)[:keep])
        self.parent._modules[self.attr] = short
        try:
            yield
        finally:
            self.parent._modules[self.attr] = self.modules


def find_stack(model: torch.nn.Module) -> Optional[Stack]:
    """The largest ModuleList of at least MIN_LAYERS identical layers, if any."""
    best: Optional[tuple[int, Stack]] = None
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_LAYERS:
            continue
        layers = list(mod)
        first = _signature(layers[0])
        if first is None or any(_signature(m) != first for m in layers[1:]):
            continue
        prefix, _, attr = path.rpartition(".")
        parent = model.get_submodule(prefix) if prefix else model
        if parent._modules.get(attr) is not mod:
            continue
        size = sum(p.numel() for p in layers[0].parameters()) * len(layers)
        if best is None or size > best[0]:
            best = (size, Stack(path, parent, attr, mod))
    if best is None or _config_varies_per_layer(model, len(best[1].modules)):
        return None
    return best[1]


def _signature(layer: torch.nn.Module) -> Optional[tuple]:
    try:
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                       for n, p in layer.named_parameters(remove_duplicate=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers(remove_duplicate=False))
        attrs = tuple((name, type(m).__qualname__, _attributes(m), _hooks(m)) for name, m in layer.named_modules())
    except Exception:  # an odd module: trace it whole
        return None
    return params, buffers, attrs


def _attributes(m: torch.nn.Module) -> tuple:
    """What of a module's own state can change what it computes: scalars, containers of scalars,
    plain tensor attributes (by value), and a forward replaced on the instance."""
    out = []
    for k, v in sorted(vars(m).items()):
        if k in _INDEX_ATTRS or (k.startswith("_") and k != "forward"):
            continue
        if isinstance(v, _SCALARS):
            out.append((k, repr(v)))
        elif isinstance(v, (list, tuple, dict, set, frozenset)):
            out.append((k, repr(v)))
        elif isinstance(v, torch.Tensor):
            out.append((k, tuple(v.shape), v.dtype, _tensor_identity(v)))
        elif callable(v):  # a forward (or helper) set on this instance only
            out.append((k, id(v)))
    return tuple(out)


def _tensor_identity(t: torch.Tensor) -> Any:
    if t.device.type == "meta" or t.numel() > 1 << 20:
        return id(t)
    return hash(t.detach().cpu().contiguous().numpy().tobytes()) if t.dtype != torch.bfloat16 else id(t)


def _hooks(m: torch.nn.Module) -> tuple:
    """Hooks run inside the module call and are traced with it: layers are the same program only
    if they carry the same hook functions."""
    return tuple(tuple(id(h) for h in getattr(m, attr, {}).values())
                 for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _config_varies_per_layer(model: torch.nn.Module, n: int) -> bool:
    """A config list with one entry per layer and more than one value (layer_types, say) means the
    layers run differently even where their modules look the same."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    if hasattr(config, "to_dict"):
        items = config.to_dict().items()
    else:
        items = [(k, getattr(config, k, None)) for k in dir(config) if not k.startswith("_")]
    for _, v in items:
        if isinstance(v, (list, tuple)) and len(v) == n and len({repr(x) for x in v}) > 1:
            return True
    return False


class _Mismatch(Exception):
    pass


def replicate(g: Graph, path: str, n_layers: int) -> Optional[Graph]:
    """The graph of the whole stack from the graph of its first two layers; None if the two layers
    are not the same program (then the caller traces everything)."""
    try:
        return _Replicator(g, path, n_layers).run()
    except _Mismatch:
        return None


class _Replicator:
    def __init__(self, g: Graph, path: str, n: int):
        self.g, self.path, self.n = g, path, n
        self.used = set(g.values) | {op.name for op in g.ops}

    def _layer(self, op: OpNode) -> Optional[int]:
        for k in (0, 1):
            p = f"{self.path}.{k}"
            if op.module_path == p or op.module_path.startswith(p + "."):
                return k
        return None

    def _state_suffix(self, name: str, k: int) -> Optional[str]:
        """For a parameter or buffer of layer k: its name inside the layer."""
        v = self.g.values.get(name)
        prefix = f"{self.path}.{k}."
        if v is None or v.kind not in ("param", "buffer") or not v.fqn or not v.fqn.startswith(prefix):
            return None
        if v.aliases:  # tied to something else: copies would not be tied the same way
            raise _Mismatch
        return v.fqn[len(prefix):]

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def run(self) -> Graph:
        g = self.g
        where = [self._layer(op) for op in g.ops]
        pos0 = [i for i, k in enumerate(where) if k == 0]
        pos1 = [i for i, k in enumerate(where) if k == 1]
        if not pos0 or len(pos0) != len(pos1):
            raise _Mismatch
        start, mid = pos0[0], pos0[-1] + 1
        if pos0 != list(range(start, mid)) or pos1 != list(range(mid, mid + len(pos1))):
            raise _Mismatch  # ops between the layers, or a layer split in pieces
        head, ops0, ops1, tail = g.ops[:start], g.ops[start:mid], g.ops[mid:mid + len(pos1)], g.ops[mid + len(pos1):]
        made0 = {o for op in ops0 for o in op.outputs if o}
        made1 = {o for op in ops1 for o in op.outputs if o}

        f: dict[str, str] = {}  # layer-0 value -> the layer-1 value in its place
        role: dict[str, tuple] = {}  # input of layer 0 from outside it -> ("shared",) | ("carry", layer-0 value)
        for a, b in zip(ops0, ops1):
            if (a.target != b.target or a.multi_output != b.multi_output or len(a.outputs) != len(b.outputs)
                    or a.grad_enabled != b.grad_enabled):
                raise _Mismatch
            pairs: list[tuple[str, str]] = []
            _match(a.args, b.args, pairs)
            _match(a.kwargs, b.kwargs, pairs)
            for r0, r1 in pairs:
                if r0 in made0:
                    if f.get(r0) != r1:
                        raise _Mismatch
                    continue
                s0 = self._state_suffix(r0, 0)
                if s0 is not None:
                    if self._state_suffix(r1, 1) != s0 or g.values[r0].meta != g.values[r1].meta:
                        raise _Mismatch
                    continue
                if r1 == r0:
                    kind: tuple = ("shared",)
                elif r1 in made0:
                    kind = ("carry", r1)
                else:
                    raise _Mismatch
                if role.setdefault(r0, kind) != kind:
                    raise _Mismatch
            for o0, o1 in zip(a.outputs, b.outputs):
                if (o0 is None) != (o1 is None):
                    raise _Mismatch
                if o0 is not None:
                    if g.values[o0].meta != g.values[o1].meta:
                        raise _Mismatch
                    f[o0] = o1
        # Layer 0's values may reach only layer 1; what comes after the stack reads layer 1's.
        if any(i in made0 for op in tail for i in op.inputs) or any(o in made0 for o in g.outputs if o):
            raise _Mismatch
        carried = {kind[1] for kind in role.values() if kind[0] == "carry"}
        used_by_1 = {i for op in ops1 for i in op.inputs if i in made0}
        if used_by_1 != carried:
            raise _Mismatch

        values = dict(g.values)
        new_ops = list(head) + list(ops0) + list(ops1)
        prev = f  # layer-0 value -> the value in its place in the last layer written
        for k in range(2, self.n):
            prev = self._copy_layer(k, ops0, made0, role, prev, values, new_ops)
        back = {v1: v0 for v0, v1 in f.items() if v0 in made0}

        def last(name: str) -> str:
            return prev[back[name]] if name in made1 else name

        for op in tail:
            new_ops.append(_remapped(op, last) if any(i in made1 for i in op.inputs) else op)
        outputs = [last(o) if o else o for o in g.outputs]
        return Graph(ops=new_ops, values=values, inputs=g.inputs, outputs=outputs,
                     output_constants=g.output_constants, out_spec=g.out_spec, model_class=g.model_class,
                     source_hash=g.source_hash, constants=g.constants)

    def _copy_layer(self, k: int, ops0: list[OpNode], made0: set[str], role: dict[str, tuple],
                    prev: dict[str, str], values: dict[str, Value], new_ops: list[OpNode]) -> dict[str, str]:
        mine: dict[str, str] = {}
        state: dict[str, str] = {}
        p0, pk = f"{self.path}.0", f"{self.path}.{k}"

        def ref(name: str) -> str:
            if name in made0:
                return mine[name]
            suffix = self._state_suffix(name, 0)
            if suffix is not None:
                if name not in state:
                    v = values[name]
                    new = self._fresh(f"{name}_l{k}")
                    values[new] = Value(new, v.kind, v.meta, fqn=f"{pk}.{suffix}", persistent=v.persistent)
                    state[name] = new
                return state[name]
            kind = role[name]
            return name if kind[0] == "shared" else prev[kind[1]]

        for op in ops0:
            outs = []
            for o in op.outputs:
                if o is None:
                    outs.append(None)
                    continue
                new = self._fresh(f"{o}_l{k}")
                mine[o] = new
                outs.append(new)
            name = self._fresh(f"{op.name}_l{k}")
            for o, new in zip(op.outputs, outs):
                if o is not None:
                    v = values[o]
                    values[new] = Value(new, "op", v.meta, producer=name)
            copy = _remapped(op, ref)
            copy.name = name
            copy.outputs = outs
            copy.module_path = pk + op.module_path[len(p0):] if op.module_path.startswith(p0) else op.module_path
            new_ops.append(copy)
        return mine


def _match(a: Any, b: Any, pairs: list[tuple[str, str]]) -> None:
    """Same structure and constants, refs paired up."""
    if isinstance(a, Ref) or isinstance(b, Ref):
        if not (isinstance(a, Ref) and isinstance(b, Ref)):
            raise _Mismatch
        pairs.append((a.name, b.name))
        return
    if type(a) is not type(b):
        raise _Mismatch
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise _Mismatch
        for x, y in zip(a, b):
            _match(x, y, pairs)
        return
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise _Mismatch
        for key in a:
            _match(a[key], b[key], pairs)
        return
    if isinstance(a, torch.Tensor):
        if not (a.shape == b.shape and a.dtype == b.dtype and not a.is_meta and torch.equal(a, b)):
            raise _Mismatch
        return
    if a != b:
        raise _Mismatch


def _remap(obj: Any, fn) -> Any:
    if isinstance(obj, Ref):
        return Ref(fn(obj.name))
    if isinstance(obj, tuple):
        return tuple(_remap(x, fn) for x in obj)
    if isinstance(obj, list):
        return [_remap(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: _remap(v, fn) for k, v in obj.items()}
    return obj


def _remapped(op: OpNode, fn) -> OpNode:
    return OpNode(name=op.name, target=op.target, args=_remap(op.args, fn), kwargs=_remap(op.kwargs, fn),
                  inputs=[fn(i) for i in op.inputs], outputs=list(op.outputs), multi_output=op.multi_output,
                  module_path=op.module_path, module_type=op.module_type, source=op.source,
                  source_code=op.source_code, grad_enabled=op.grad_enabled)
