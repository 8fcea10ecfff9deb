"""Model capture: `torch.export` (non-strict, training IR) turned into a plain `Graph`.

Capture never runs the model's arithmetic on real data when the model lives on the meta device:
export traces with fake tensors, so a 175B-parameter configuration is captured on a laptop.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import io
import logging
import operator
import os
import re
import sys
import traceback
from typing import Any, Iterator, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from nnscaler_plugins.batches import example_settings, normalize_inputs
from nnscaler_plugins.capture.autograd_functions import (
    FunctionCaptureError,
    is_opaque_call,
    opaque_functions,
    rebuild_call,
)
from nnscaler_plugins.capture.causal_mask import fold_causal_masks
from nnscaler_plugins.capture.dead_code import ASSERTIONS, drop_dead_code
from nnscaler_plugins.capture.constant_index import slices_for_constant_index
from nnscaler_plugins.capture.experts import experts_as_one_op
from nnscaler_plugins.capture.flex_attention import flex_attention_as_one_op
from nnscaler_plugins.capture.fused_sections import split_fused_sections
from nnscaler_plugins.capture.graph import (
    Graph,
    InputSpec,
    OpNode,
    Ref,
    TensorMeta,
    Value,
)
from nnscaler_plugins.capture.repeated_layers import Stack, find_stack, replicate
from nnscaler_plugins.capture.shape_values import FoldedRead, ShapeValues
from nnscaler_plugins.plugins import get_plugin_manager
from nnscaler_plugins.progress import phase

_log = logging.getLogger(__name__)
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


class CaptureError(RuntimeError):
    """The model could not be captured; the message says which line and what to try, in a few
    lines. `details` keeps torch.export's own report for when that is not enough."""

    details: str = ""


@contextlib.contextmanager
def unmoved_random_streams() -> Iterator[None]:
    """The process's random streams as they were on entry, whatever ran inside: torch's CPU generator
    and the current GPU's, Python's `random` and NumPy's global one. Capture draws nothing the user's
    loop would see (torch.export itself advances torch's generator while tracing, even for a model with
    no random op), so the first real step draws what it would without us."""
    import random

    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    py_state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def capture(model: torch.nn.Module, args: Any = (), kwargs: Optional[dict] = None, *,
            trace_repeated_layers_once: bool = True) -> Graph:
    """Capture `model(*args, **kwargs)` as a `Graph`.

    `args` may be a tuple, a single tensor, or a dict (taken as keyword arguments), matching how
    `parallelize` receives example inputs. Plugins may adapt the model first (the Hugging Face
    plugin turns off the KV cache) through the `nnscaler_adapt_model_for_capture` hook.

    A value read (`bool(t)`, `t.item()`) on a tensor made from sizes and constants alone, such as
    nn.Transformer's check that its mask is causal, is answered while tracing (shape_values.py;
    `Graph.folded` lists the answers); one on data is refused with a CaptureError naming the line.

    A stack of identical layers is traced two layers deep and the rest written as copies (see
    repeated_layers.py); `trace_repeated_layers_once=False` traces every layer.

    Once traced, the cyclic garbage tracing made is collected: torch.export leaves its tracer behind
    in reference cycles (a module-stack tracer whose proxies and closures reference the traced
    model), which would keep the model, every weight of it, alive after the caller lets go of it,
    until the collector happened to run. A ZeRO-3 rank then held the whole model beside its quarter
    through its first training steps (a GPT-2-shaped model: 14 MiB of 138 at the rank's peak). The
    objects that existed before capture are frozen meanwhile (`gc.freeze`), so the collection looks
    at what tracing made only: a millisecond or two, where a full collection of a process with
    400,000 objects takes 0.2 s. A process that froze objects of its own gets a full collection.
    """
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with unmoved_random_streams():
            return _capture(model, args, kwargs, trace_repeated_layers_once)
    finally:
        gc.collect()
        if freeze:
            gc.unfreeze()


def _capture(model: torch.nn.Module, args: Any, kwargs: Optional[dict], trace_repeated_layers_once: bool) -> Graph:
    args, kwargs = _distinct_inputs(*normalize_inputs(args, kwargs))
    pm = get_plugin_manager()
    with contextlib.ExitStack() as stack:
        # a large model takes a while: said when it took more than a couple of seconds
        stack.enter_context(phase(f"capturing {type(model).__name__}"))
        for ctx in pm.hook.nnscaler_adapt_model_for_capture(model=model, kwargs=kwargs):
            if ctx is not None:
                stack.enter_context(ctx)
        stack.enter_context(opaque_functions())  # custom autograd Functions stay one op each
        # experts modules called with rows sorted by expert and their counts stay one op each: the
        # split sizes they read from the counts are data (routed ones only when a strategy asks)
        stack.enter_context(experts_as_one_op(model, routed=False))
        stack.enter_context(flex_attention_as_one_op())  # its score / mask functions held by the op
        stack.enter_context(_recorded_contiguous())
        layers = find_stack(model) if trace_repeated_layers_once else None
        traced = ""
        if layers is not None:
            graph, why = _capture_two_layers(model, args, kwargs, layers)
            if graph is not None:
                folded = graph.folded
                graph = split_fused_sections(slices_for_constant_index(graph))
                graph.traced = "two layers"
                graph.folded = folded
                graph.settings = example_settings(args, kwargs)
                return graph
            traced = f"whole: {why}"
            _log.info("%s: traced all %d layers of %s (%s)", type(model).__name__, len(layers.modules),
                      layers.path, why)
        ep, folded = _export(model, args, kwargs)
        fold_causal_masks(ep)  # traced HF models build their causal mask as a tensor; give sdpa is_causal back
        drop_dead_code(ep)  # what only export's assertions read (the folded mask's chain)
        # one matmul per unequal section of a fused projection, constant index runs read as slices
        graph = split_fused_sections(slices_for_constant_index(_to_graph(ep, model, args, kwargs)))
        graph.traced = traced
        graph.folded = folded
        graph.settings = example_settings(args, kwargs)
        return graph


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The same tensor passed twice (`{"input_ids": ids, "labels": ids}`) becomes two tensors.

    torch.export gives one tensor object one placeholder's worth of identity, so the graph may read
    `labels` where the model read `input_ids`; a later batch whose labels differ (padding of -100)
    would then be embedded as tokens. Copies keep every input its own."""
    seen: set[int] = set()

    def own(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    leaves, spec = pytree.tree_flatten((args, kwargs))
    return pytree.tree_unflatten([own(x) for x in leaves], spec)


@contextlib.contextmanager
def _recorded_contiguous() -> Iterator[None]:
    """Every `.contiguous()` call becomes an op, even on a tensor that already is contiguous.

    Tensor.contiguous returns its input before dispatch when the strides already fit, so whether
    the op appears in the graph depends on the strides the device's kernels produce (CPU
    attention returns a layout whose transpose is contiguous; meta kernels do not). A plan made
    on a meta-device capture must match the graph of the real model, so capture records the call
    either way; at run time the op returns its input unchanged when there is nothing to do."""
    original = torch.Tensor.contiguous

    def contiguous(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        return torch.ops.aten.contiguous.default(self, memory_format=memory_format)

    torch.Tensor.contiguous = contiguous
    try:
        yield
    finally:
        torch.Tensor.contiguous = original


#: torch.export's non-strict tracer, on a model it traces without fault again and again, once in a
#: long run of captures in one process reported a tensor made outside the trace as a fake constant
#: ("lifted_tensor_0") and refused the model. It was not reproduced; a second trace after a garbage
#: collection is the remedy for that message alone: one the model itself causes fails twice and is
#: reported as before.
_STRAY_FAKE_CONSTANT = "fake tensor in the exported program constant's list"


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.export.ExportedProgram,
                                                                       tuple[FoldedRead, ...]]:
    """torch.export, and the value reads answered while it traced (shape_values.py), quietly: on
    failure it prints the partial graph to stderr and logs warnings, hundreds of lines per rank. The
    user gets one short CaptureError naming their line; torch's full report stays in
    `CaptureError.details`."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        for attempt in range(2):
            noise = io.StringIO()
            known = ShapeValues()  # value reads on tensors made from sizes alone are answered, not refused
            try:
                with contextlib.redirect_stderr(noise), known:
                    ep = torch.export.export(model, tuple(args), kwargs, strict=False)
                break
            except Exception as e:  # torch.export raises many types; say what it means for the user
                if attempt == 0 and _STRAY_FAKE_CONSTANT in str(e):
                    gc.collect()  # see _STRAY_FAKE_CONSTANT: traced once more, from a collected heap
                    continue
                raise _capture_error(model, e, noise.getvalue(), known.too_large_hint()) from None
    finally:
        torch_log.setLevel(level)
    if noise.getvalue():
        sys.stderr.write(noise.getvalue())  # what the model itself printed or warned while traced
    return ep, tuple(known.reads)


_CALL_RE = re.compile(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _user_frame(e: BaseException) -> Optional[tuple[str, int, str, str]]:
    """(file, line, function, code) of the model line that failed: torch's own pointer when it
    gives one, else the innermost frame outside torch and this library."""
    m = _CALL_RE.search(str(e))
    if m:
        return m.group(1), int(m.group(2)), m.group(3), m.group(4).strip()
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        f = os.path.abspath(frame.filename)
        if f"{os.sep}torch{os.sep}" in f or f.startswith(here):
            continue
        return frame.filename, frame.lineno or 0, frame.name, (frame.line or "").strip()
    return None


def _capture_error(model: torch.nn.Module, e: BaseException, printed: str, hint: str = "") -> "CaptureError":
    name = type(model).__name__
    frame = _user_frame(e)
    at = f" at {os.path.basename(frame[0])}:{frame[1]} (in {frame[2]})" if frame else ""
    code = f"\n    {frame[3]}" if frame and frame[3] else ""
    cause = e
    while cause.__cause__ is not None and not isinstance(cause, FunctionCaptureError):
        cause = cause.__cause__
    kind = type(e).__name__
    if isinstance(cause, FunctionCaptureError):
        text = f"cannot capture {name}{at}:{code}\n{cause}"
    elif "DataDependent" in kind or "data-dependent" in str(e):
        text = (f"cannot capture {name}: its forward reads a tensor's value to decide what to run{at}:{code}\n"
                "Capture traces with symbolic values; only tensors made from sizes and constants alone have a "
                "value then (this one depends on an input, a parameter, a buffer or a random draw). "
                "Compute the condition from shapes or the config, use "
                "torch.where for value-dependent choices, or move the check out of forward. Split sizes of a "
                "mixture-of-experts layer (`counts.tolist()`) belong inside an experts module called as "
                "experts(rows sorted by expert, counts per expert), with stacked (experts, ...) weights or a "
                "ModuleList of experts: capture keeps it as one op and reads the sizes at run time.")
        if hint:  # the tensor read was made from sizes alone, but too large to compute at capture
            text = f"cannot capture {name}{at}:{code}\n{hint}"
    else:
        first = next((line for line in str(e).splitlines() if line.strip()), "")[:300]
        text = (f"cannot capture {name}{at}:{code}\ntorch.export: {kind}: {first}\n"
                "Register a custom op (torch.library) for code torch.export cannot trace, or simplify the forward.")
    err = CaptureError(text + "\n(torch.export's full report: CaptureError.details)")
    err.details = f"{kind}: {e}\n{printed}"
    return err


def _capture_two_layers(model: torch.nn.Module, args: tuple, kwargs: dict,
                        layers: Stack) -> tuple[Optional[Graph], str]:
    """The graph with every layer of `layers`, traced with two of them; else None and why not
    (the model minds its layer count, or its two layers are not one program): it is traced whole."""
    try:
        with layers.truncated(2):
            ep, folded = _export(model, args, kwargs)
            fold_causal_masks(ep)
            drop_dead_code(ep)
            short = _to_graph(ep, model, args, kwargs)
    except Exception as e:  # anything at all: the whole trace says what is wrong, if something is
        said = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # CaptureError: where, then why
        return None, f"tracing two layers failed: {type(e).__name__}: {said[:300]}"
    graph = replicate(short, layers.path, len(layers.modules))
    if graph is not None:
        graph.folded = folded
    return graph, "" if graph is not None else "its first two layers do not trace as one program"


def _model_source_hash(model: torch.nn.Module) -> str:
    """Hash of the source of every module class used by the model (for the code cache key)."""
    h = hashlib.sha256()
    seen = set()
    for m in model.modules():
        cls = type(m)
        if cls in seen:
            continue
        seen.add(cls)
        try:
            h.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):
            h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    return h.hexdigest()[:16]


_LIBRARY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_of(node: torch.fx.Node) -> tuple[str, str]:
    """The most user-relevant frame: the last one outside torch and this library (an experts
    module recorded as one op is the model's call of it, not the wrapper's line)."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME_RE.findall(trace)
    if not frames:
        return "", ""
    pick = frames[-1]
    # generated code (`<eval_with_key>.N`, torch's own compiled wrappers) is nobody's source line
    outside_torch = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0] and not f[0].startswith("<")]
    user = [f for f in outside_torch if not os.path.abspath(f[0]).startswith(_LIBRARY_DIR + os.sep)]
    if user or outside_torch:
        pick = (user or outside_torch)[-1]
    path, line, _fn, code = pick
    return f"{os.path.basename(path)}:{line}", code.strip()


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return path, cls_name.rsplit(".", 1)[-1]


def _differentiable(val: Any) -> bool:
    """Whether autograd can carry a gradient through this value. Complex values count: an fft
    between two layers passes gradients through complex intermediates, and a chain marked
    gradient-free would lose the communication its backward needs."""
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def _meta_of(val: Any, requires_grad: bool = False) -> Optional[TensorMeta]:
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(_size(s) for s in val.shape), val.dtype, requires_grad)
    return None


#: Higher-order ops refused by name, with what to use instead. Calls of FlexAttention by its name
#: are captured as one op (capture/flex_attention.py); one reaching the trace as torch's own
#: higher-order op came through a reference capture did not replace (an attribute holding it).
_REFUSED_HOPS = {"flex_attention": "FlexAttention (torch.nn.attention.flex_attention.flex_attention)",
                 "flex_attention_backward": "FlexAttention (torch.nn.attention.flex_attention.flex_attention)"}
_FLEX_WAYS = ("it was called through a reference capture does not replace (an attribute holding the function, "
              "torch.compile(flex_attention)), so it cannot be kept as one op. Call torch.nn.attention.flex_attention.flex_attention itself in the model (the plan's "
              "generated code runs it), or: a causal mask -> F.scaled_dot_product_attention(q, k, v, is_causal=True) "
              "(batch and heads split, and the sequence under cp); documents packed into one row or a sliding window "
              "-> torch.nn.attention.varlen.varlen_attn(..., window_size=(w, 0)) (heads split)")
_REFUSED_HOP_WAYS = {"flex_attention": _FLEX_WAYS, "flex_attention_backward": _FLEX_WAYS}


def _refuse_named_hops(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        hop = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if hop in _REFUSED_HOPS and isinstance(node.target, torch._ops.HigherOrderOperator):
            raise CaptureError(f"{_REFUSED_HOPS[hop]} at {_source_of(node)[0]}: {_REFUSED_HOP_WAYS[hop]}")


class _Converter:
    def __init__(self, ep: torch.export.ExportedProgram, model: torch.nn.Module):
        self.ep = ep
        self.model = model
        self.values: dict[str, Value] = {}
        self.ops: list[OpNode] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.used_names: set[str] = set()

    # names -----------------------------------------------------------------------------
    def fresh(self, name: str) -> str:
        base, i = name, 1
        while name in self.used_names:
            name = f"{base}_{i}"
            i += 1
        self.used_names.add(name)
        return name

    def resolve(self, a: Any) -> Any:
        return torch.fx.node.map_aggregate(a, lambda x: self.env[x] if isinstance(x, torch.fx.Node) else x)

    def requires_grad(self, refs: list[str]) -> bool:
        return any(self.values[r].meta is not None and self.values[r].meta.requires_grad for r in refs)

    def autograd_says(self, target: Any, args: tuple, kwargs: dict) -> bool:
        """Whether autograd gives the op's output a gradient, asked by running the op on meta tensors
        with its inputs' flags: an input that only lends a dtype or a size (`mask.type_as(h)`,
        `h.new_zeros(...)`) passes none. A value marked as needing one that never gets it would wait
        forever for its gradient at a pipeline boundary. Ops that cannot run on meta keep the rule
        "any input needs a gradient"."""
        if not isinstance(target, torch._ops.OpOverload):
            return True

        def meta(x: Any) -> Any:
            if not isinstance(x, Ref):
                return x
            m = self.values[x.name].meta
            t = torch.empty(m.shape, dtype=m.dtype, device="meta")
            return t.requires_grad_(True) if m.requires_grad and _differentiable(t) else t

        try:
            with torch.enable_grad():
                out = target(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))
        except Exception:  # noqa: BLE001 - no meta kernel, an in-place op on a leaf: the simple rule
            return True
        return any(isinstance(o, torch.Tensor) and o.requires_grad for o in pytree.tree_leaves(out))

    # graph walk --------------------------------------------------------------------------
    def run(self, graph: torch.fx.Graph, grad_enabled: bool = True, prefix: str = "") -> list[Any]:
        outputs: list[Any] = []
        _refuse_named_hops(graph)  # before the ops building their inputs (a block mask) fail less clearly
        for node in graph.nodes:
            if node.op == "placeholder":
                continue  # bound by the caller
            if node.op == "output":
                outputs = list(self.resolve(node.args[0]))
                continue
            if node.op == "get_attr":
                self.env[node] = getattr(self.ep.graph_module, node.target)
                continue
            if node.op != "call_function":
                raise CaptureError(f"unexpected fx node {node.op} {node.target}")
            target = node.target
            if target is operator.getitem:
                src = self.env[node.args[0]]
                self.env[node] = src[node.args[1]]
                continue
            tname = str(target)
            if tname in ASSERTIONS:  # no runtime effect in generated code
                continue
            hop = getattr(target, "__name__", "") or tname
            if hop == "wrap_with_set_grad_enabled":
                enabled, sub, *sub_args = node.args
                self.inline(node, self.env[sub], sub_args, grad_enabled=bool(enabled))
                continue
            if isinstance(target, torch._ops.HigherOrderOperator):
                raise CaptureError(
                    f"{tname} (a higher-order op) at {_source_of(node)[0]} is not supported yet; "
                    "move that region out of torch.autocast / control-flow constructs before capture")
            self.add_op(node, target, grad_enabled, prefix)
        return outputs

    def inline(self, node: torch.fx.Node, sub: torch.fx.GraphModule, sub_args: list, grad_enabled: bool) -> None:
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, a in zip(placeholders, sub_args):
            self.env[ph] = self.resolve(a)
        outs = self.run(sub.graph, grad_enabled=grad_enabled, prefix=node.name + "_")
        self.env[node] = tuple(outs)

    def add_op(self, node: torch.fx.Node, target: Any, grad_enabled: bool, prefix: str) -> None:
        args = self.resolve(node.args)
        kwargs = self.resolve(dict(node.kwargs))
        single = False
        base = node.name
        if is_opaque_call(target):  # a custom autograd Function: call the user's class itself
            target, args, kwargs, single = rebuild_call(args)
            base = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", target.cls.__name__).lower()
        inputs: list[str] = []
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, Ref) and self.values[leaf.name].meta is not None:
                inputs.append(leaf.name)
        name = self.fresh(prefix + base)
        val = node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, torch.Tensor) and any(_data_decides(d) for d in v.shape):
                raise _data_dependent_error(node, target, v.shape)  # a row count only the data decides
        rg = grad_enabled and self.requires_grad(inputs)
        if rg and not all(self.requires_grad([r]) for r in inputs):
            rg = self.autograd_says(target, args, kwargs)
        module_path, module_type = _module_of(node)
        source, code = _source_of(node)
        if single:  # the Function returned one tensor; the opaque op returned a list of it
            val = val[0]
            meta = _meta_of(val, rg and _differentiable(val))
            self.values[name] = Value(name, "op", meta, producer=name)
            outs = [name]
            self.env[node] = (Ref(name),)  # the getitem(..., 0) after the call reads it
            multi = False
        elif isinstance(val, (tuple, list)):
            outs: list[Optional[str]] = []
            refs = []
            for i, v in enumerate(val):
                meta = _meta_of(v, rg and _differentiable(v))
                if meta is None:
                    outs.append(None)
                    refs.append(v)
                    continue
                oname = self.fresh(f"{name}_{i}")
                self.values[oname] = Value(oname, "op", meta, producer=name)
                outs.append(oname)
                refs.append(Ref(oname))
            self.env[node] = tuple(refs)
            multi = True
        else:
            known = _known_number(val)
            if known is not None:
                # a size or a check torch.export proved static (torch._check told it the size):
                # the number itself, no op
                self.env[node] = known
                return
            meta = _meta_of(val, rg and _differentiable(val))
            if meta is None and val is not None:
                raise _data_dependent_error(node, target, val)
            outs = [name] if meta is not None else [None]
            if meta is not None:
                self.values[name] = Value(name, "op", meta, producer=name)
            self.env[node] = Ref(name) if meta is not None else None
            multi = False
        self.ops.append(OpNode(name=name, target=target, args=tuple(args), kwargs=kwargs, inputs=inputs,
                               outputs=outs, multi_output=multi, module_path=module_path,
                               module_type=module_type, source=source, source_code=code,
                               grad_enabled=grad_enabled))


def _known_number(val: Any) -> Optional[Any]:
    """A plain number for a Python number, or for a symbolic one whose value torch.export knows
    (a size made static by `torch._check`); None otherwise."""
    if isinstance(val, (bool, int, float)):
        return val
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        expr = val.node.expr
        try:
            expr = val.node.shape_env.replace(expr)
        except Exception:  # noqa: BLE001 - no shape environment to ask: the expression as it is
            pass
        if getattr(expr, "is_number", False) or getattr(expr, "is_Boolean", False):
            kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(val)]
            return kind(expr)
    return None


def _size(size: Any) -> int:
    """A dim's length: its known value, else what torch.export assumed for it (its hint)."""
    known = _known_number(size)
    return int(size if known is None else known)


def _data_decides(size: Any) -> bool:
    """A size with no value torch.export knows or can assume (an unbacked one)."""
    if not isinstance(size, torch.SymInt) or _known_number(size) is not None:
        return False
    try:
        return not size.node.has_hint()
    except Exception:  # noqa: BLE001 - no hint to ask for: treat as decided by the data
        return True


def _data_dependent_error(node: torch.fx.Node, target: Any, val: Any) -> CaptureError:
    """The refusal of a value only the data decides (a `.tolist()`, an `.item()`, the row count of
    `masked_select` or `nonzero`), naming the model line and the ways out."""
    source, code = _source_of(node)
    op = getattr(target, "__name__", None) or str(target)
    at = f" at {source}" if source else ""
    line = f"\n    {code}" if code else ""
    err = CaptureError(
        f"cannot capture the model{at}: {op} gives a {'size' if isinstance(val, torch.Size) else type(val).__name__} "
        f"only the data decides (a `.tolist()`, `.item()`, or the row count of masked_select / nonzero){line}\n"
        "A plan needs every size before the data is seen. Ways out: keep the per-expert work in an experts module "
        "called as `experts(rows sorted by expert, counts per expert)` with its weights stacked (experts, ...) or as "
        "a ModuleList of experts (captured as one op, its split sizes read at run time); where the size is known, "
        "say so with `torch._check(t.shape[0] == n)` after the line; or compute it with shape-keeping ops "
        "(argsort, gather, scatter_add, torch.where).")
    err.details = f"{op} -> {val!r} at {source}"
    return err


def _to_graph(ep: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple, kwargs: dict) -> Graph:
    conv = _Converter(ep, model)
    sig = ep.graph_signature
    # Tied parameters: every FQN that points to the same tensor object.
    same: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        same.setdefault(id(p), []).append(fqn)
    param_aliases = {names[0]: names for names in same.values()}
    for names in same.values():
        for n in names:
            param_aliases[n] = names

    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user_leaves = _flatten_user_inputs(args, kwargs)
    user_specs = [s for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    tensor_leaves = [(p, v) for p, v in user_leaves if isinstance(v, torch.Tensor)]
    leaves_for_inputs = tensor_leaves if len(tensor_leaves) == len(user_specs) else user_leaves
    user_iter = iter(leaves_for_inputs)
    inputs: list[InputSpec] = []
    K = torch.export.graph_signature.InputKind
    for ph, spec in zip(placeholders, sig.input_specs):
        name = conv.fresh(ph.name)
        val = ph.meta.get("val")
        if spec.kind == K.PARAMETER:
            fqn = spec.target
            p = model.get_parameter(fqn)
            aliases = tuple(a for a in param_aliases.get(fqn, [fqn]) if a != fqn)
            conv.values[name] = Value(name, "param", _meta_of(val, p.requires_grad), fqn=fqn, aliases=aliases)
        elif spec.kind == K.BUFFER:
            conv.values[name] = Value(name, "buffer", _meta_of(val), fqn=spec.target,
                                      persistent=spec.persistent is not False)
        elif spec.kind in (K.CONSTANT_TENSOR,):
            conv.values[name] = Value(name, "constant", _meta_of(val), fqn=spec.target)
        elif spec.kind == K.USER_INPUT:
            path, leaf = next(user_iter)
            rg = isinstance(leaf, torch.Tensor) and leaf.requires_grad
            conv.values[name] = Value(name, "input", _meta_of(val, rg))
            inputs.append(InputSpec(name, path))
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind} for {ph.name}")
        conv.env[ph] = Ref(name) if conv.values[name].meta is not None else val

    outs = conv.run(ep.graph)
    n_user = len([s for s in sig.output_specs if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT])
    if n_user != len(outs):
        raise CaptureError("the model mutates buffers in forward (e.g. BatchNorm running stats); "
                           "this is not supported yet: put such modules in eval mode or replace them")
    out_names: list[Optional[str]] = []
    out_consts: list[Any] = []
    for o in outs:
        if isinstance(o, Ref):
            out_names.append(o.name)
            out_consts.append(None)
        else:
            out_names.append(None)
            out_consts.append(o)
    g = Graph(ops=conv.ops, values=conv.values, inputs=inputs, outputs=out_names, output_constants=out_consts,
              out_spec=ep.call_spec.out_spec, model_class=type(model).__name__,
              source_hash=_model_source_hash(model), constants=dict(ep.constants))
    return g


def _flatten_user_inputs(args: tuple, kwargs: dict) -> list[tuple[tuple, Any]]:
    out = []
    for i, a in enumerate(args):
        for kp, leaf in pytree.tree_flatten_with_path(a)[0]:
            out.append((("args", i) + tuple(_key(k) for k in kp), leaf))
    for k, a in kwargs.items():
        for kp, leaf in pytree.tree_flatten_with_path(a)[0]:
            out.append((("kwargs", k) + tuple(_key(x) for x in kp), leaf))
    return out


def _key(k: Any) -> Any:
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)

