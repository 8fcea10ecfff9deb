"""Tensors made from sizes and constants alone have a value at capture: a read of it is answered.

Why: capture traces with fake tensors, so `bool(t)`, `t.item()` or `t.tolist()` has no value to give
and torch.export refuses the model ("its forward reads a tensor's value"). Much code that does this
reads no data at all: torch's own `nn.Transformer` / `nn.TransformerEncoder` compare the mask they are
given with a freshly made causal one (`bool((mask == causal).all())`, `_detect_is_causal_mask`) to
pick the causal kernel, and that mask is itself made from `x.size(1)` by `torch.triu(torch.full(...))`.
Eagerly those reads always give the same answer for the same sizes.

While a model is traced, `ShapeValues` (a torch function mode) keeps beside each fake tensor that
was made only from Python numbers, sizes (concrete at capture) and other such tensors its real value,
computed on the CPU (ops that read only their argument's size, `torch.ones_like(scores)`, count as
made from sizes); no input, parameter, buffer or tensor that existed before the trace is ever one of
them. A value read on such a tensor returns that value instead of a symbol; the graph keeps every op
that made the tensor, so the program computes it as eager does. A value read on anything else (data)
is left to torch.export, which refuses it by name as before. What decides a tensor is kept:
- an op that draws random numbers (it moves the CPU generator; the generator is put back) or leaves
  memory uninitialized (`empty*`, `resize_`) gives no known value;
- a tensor changed in place by an op with an unknown input loses its value (its version counter moved
  outside an op computed here), and so does every tensor sharing its storage;
- a value larger than `MAX_ELEMENTS` is not computed: a read on it, or on what is made from it, is
  refused, the message saying so.

Each read answered is recorded (`FoldedRead`: the model's line and the answer), kept on the Graph as
`Graph.folded`. Capture is at fixed sizes, so an answer is to the sizes what a Python branch on
`x.size(1)` is: the shape programs (compiler/shapes.py) make the programs of other sizes from captures
at other sizes, where the read is answered again; an answer that changes only a number is fitted as a
size is, one that changes the ops is refused at that size, never run with the example's program.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

#: Largest tensor (elements) whose value is computed beside the trace: a 4096 x 4096 mask.
MAX_ELEMENTS = 1 << 24

#: The calls by which Python reads a tensor's value; on a tensor of known value they are answered.
_VALUE_READS: frozenset = frozenset({
    torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__complex__, torch.equal, torch.is_nonzero,
    torch.Tensor.__contains__, torch.Tensor.numpy,
})
_DEVICE_KEYS = ("device",)
#: Ops that read only the size, dtype and device of their first argument, never its values: made from
#: an input (`torch.ones_like(scores)`), their result is still made from sizes alone.
_METADATA_ONLY: frozenset = frozenset({
    torch.ones_like, torch.zeros_like, torch.full_like, torch.Tensor.new_ones, torch.Tensor.new_zeros,
    torch.Tensor.new_full,
})


@dataclasses.dataclass(frozen=True)
class FoldedRead:
    """A value read answered at capture: what read it, the model's line, and the answer."""

    call: str  # e.g. "Tensor.__bool__"
    source: str  # "transformer.py:1245"
    code: str
    value: str  # repr of the answer, shortened

    def describe(self) -> str:
        at = f" at {self.source}" if self.source else ""
        return f"{self.call}{at} -> {self.value}"


class _Unknown(Exception):
    """The real value cannot be computed here; the tensor stays unknown."""


def _name(func: Callable) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    owner = getattr(func, "__objclass__", None)
    if owner is torch.Tensor or qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "Tensor." + qual.split(".")[-1]
    if qual.startswith("_VariableFunctionsClass."):  # torch.equal, torch.ones: torch's C functions
        return "torch." + qual.split(".")[-1]
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{qual}" if module and not qual.startswith(module) else qual


def _uninitialized(name: str) -> bool:
    """Ops whose result holds memory nobody wrote (`empty*`, a `resize_` that grows)."""
    short = name.rsplit(".", 1)[-1]
    return "empty" in short or "resize" in short


_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = f"{os.sep}torch{os.sep}"
# torch's tracing machinery between the model's line and this mode: nobody's source line
_MACHINERY = (f"{_TORCH}_", f"{_TORCH}overrides.py", f"{_TORCH}utils{os.sep}", f"{_TORCH}fx{os.sep}")


def _caller() -> tuple[str, str]:
    """Where the read was made (innermost frame outside torch's tracing machinery) and, when that
    is torch's own code (`_detect_is_causal_mask` in nn.Transformer), the model's line that called
    it: the one a user recognises."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if not os.path.abspath(f.filename).startswith(_HERE) and not any(m in f.filename for m in _MACHINERY)
              and not f.filename.startswith("<") and "contextlib" not in f.filename]
    user = [f for f in frames if _TORCH not in f.filename]
    pick = frames[-1] if frames else None
    if pick is None:
        return "", ""
    where = f"{os.path.basename(pick.filename)}:{pick.lineno}"
    if user and pick is not user[-1]:
        where += f" (from {os.path.basename(user[-1].filename)}:{user[-1].lineno})"
    return where, (pick.line or "").strip()


class ShapeValues(TorchFunctionMode):
    """Enter around a trace: tensors whose value is known beside it, and the value reads answered.

    Only tensors made while the mode is active are ever known. `reads` lists what was answered."""

    def __init__(self) -> None:
        super().__init__()
        self.known = WeakIdKeyDictionary()  # fake tensor -> (real CPU value, fake's version when set)
        self.reads: list[FoldedRead] = []
        # tensors made from sizes alone whose value was too large to compute -> their element count,
        # and the read that met one (where, elements): the refusal then says so
        self.large = WeakIdKeyDictionary()
        self.large_read: Optional[tuple[str, int]] = None

    # -- what a tensor's value is -------------------------------------------------------------------------
    def value_of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        entry = self.known.get(t)
        if entry is None:
            return None
        real, version = entry
        if t._version != version:  # changed in place by an op not computed here
            self._forget_storage(real)
            return None
        return real

    def _forget_storage(self, real: torch.Tensor) -> None:
        ptr = _storage(real)
        for key, (other, _v) in list(self.known.items()):
            if other is real or (ptr and _storage(other) == ptr):
                self.known.pop(key, None)

    def _real_args(self, args: tuple, kwargs: dict, template: Optional[torch.Tensor] = None) -> tuple[tuple, dict]:
        def real(x: Any) -> Any:
            if template is not None and x is template:  # only its size and dtype are read
                return torch.zeros(tuple(x.shape), dtype=x.dtype)
            if isinstance(x, torch.Tensor):
                v = self.value_of(x)
                if v is None:
                    raise _Unknown
                return v
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise _Unknown  # a size only the data decides
            if isinstance(x, torch.device):
                return torch.device("cpu")
            if isinstance(x, torch.Generator):
                raise _Unknown
            return x

        args = pytree.tree_map(real, args)
        kwargs = pytree.tree_map(real, kwargs)
        for key in _DEVICE_KEYS:
            if key in kwargs and kwargs[key] is not None:
                kwargs[key] = torch.device("cpu")
        kwargs.pop("pin_memory", None)
        return args, kwargs

    def _compute(self, func: Callable, args: tuple, kwargs: dict, template: Optional[torch.Tensor] = None) -> Any:
        """`func` on the real values, with tracing and every mode off; _Unknown when it cannot run
        here or draws random numbers (the CPU generator is put back where it was)."""
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            rargs, rkwargs = self._real_args(args, kwargs, template)  # a template's stand-in made here, real
            state = torch.random.get_rng_state()
            try:
                out = func(*rargs, **rkwargs)
            except Exception:  # noqa: BLE001 - an op that needs its device, a sparse layout...: unknown
                raise _Unknown from None
            finally:
                moved = not torch.equal(state, torch.random.get_rng_state())
                if moved:
                    torch.random.set_rng_state(state)
        if moved:
            raise _Unknown
        return out

    # -- the mode -------------------------------------------------------------------------------------
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # torch.compile inside the trace (FlexAttention's own) traces
            return func(*args, **kwargs)          # through modes: nothing here for it to follow
        leaves = _leaves((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if func in _VALUE_READS and tensors and all(self.value_of(t) is not None or t in self.large for t in tensors):
            if any(t in self.large for t in tensors):
                self.large_read = (_caller()[0], max(self.large.get(t, 0) for t in tensors))
                return func(*args, **kwargs)
            try:
                answer = self._compute(func, args, kwargs)
            except _Unknown:
                return func(*args, **kwargs)
            where, code = _caller()
            text = repr(answer)
            self.reads.append(FoldedRead(_name(func), where, code, text if len(text) <= 80 else text[:77] + "..."))
            return answer
        template = None
        if func in _METADATA_ONLY and args and isinstance(args[0], torch.Tensor) and _concrete(args[0]) \
                and self.value_of(args[0]) is None:
            template = args[0]  # its values are not read: the result is made from its size alone
            tensors = [t for t in tensors if t is not template]
        known = [t for t in tensors if self.value_of(t) is not None]
        knowable = (len(known) == len(tensors) and not _uninitialized(_name(func))
                    and not any(isinstance(x, torch.Generator) for x in leaves))
        versions = [t._version for t in known]
        out = func(*args, **kwargs)
        if not knowable:
            ids = {id(t) for t in known}
            if len(known) < len(tensors) and all(id(t) in ids or t in self.large for t in tensors) \
                    and not _uninitialized(_name(func)):
                self._mark_large(out, max(self.large.get(t, 0) for t in tensors))
            # what it wrote in place is unknown, and so is every tensor on that storage (`.data`, a
            # `detach()`ed alias and their base count their versions apart)
            self._after_unknown_write(known, versions)
            return out
        fakes = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        wrote = any(t._version != v for t, v in zip(tensors, versions))
        if not fakes and not wrote:  # a size, a dtype, a device: nothing to keep
            return out
        if any(not _concrete(f) for f in fakes):
            self._after_unknown_write(tensors, versions)
            return out
        if any(f.numel() > MAX_ELEMENTS for f in fakes):
            self._after_unknown_write(tensors, versions)
            self._mark_large(out, max(f.numel() for f in fakes))
            return out
        try:
            real_out = self._compute(func, args, kwargs, template)
        except _Unknown:
            self._after_unknown_write(tensors, versions)
            return out
        reals = [x for x in pytree.tree_leaves(real_out) if isinstance(x, torch.Tensor)]
        # a plain CPU tensor of the traced one's size and dtype, or nothing is kept (never a fake one)
        if len(reals) != len(fakes) or any(type(r) is not torch.Tensor or r.shape != f.shape or r.dtype != f.dtype
                                           for r, f in zip(reals, fakes)):
            self._after_unknown_write(tensors, versions)
            return out
        # the inputs written in place were written on their real values too: their views' and their
        # own versions moved here, by an op computed on both sides
        moved = {_storage(self.known[t][0]) for t, v in zip(tensors, versions) if t._version != v}
        if moved:
            for key, (real, _v) in list(self.known.items()):
                if _storage(real) in moved:
                    self.known[key] = (real, key._version)
        for f, r in zip(fakes, reals):
            self.known[f] = (r, f._version)
        return out

    def _mark_large(self, out: Any, elements: int) -> None:
        for f in pytree.tree_leaves(out):
            if isinstance(f, torch.Tensor) and _concrete(f):
                self.large[f] = max(elements, f.numel())

    def too_large_hint(self) -> str:
        """For a refusal: the read that met a tensor made from sizes alone but too large to compute."""
        if self.large_read is None:
            return ""
        where, elements = self.large_read
        return (f"The value read at {where} is of a tensor made from sizes alone, but one of {elements:,} elements, "
                f"more than capture computes beside the trace ({MAX_ELEMENTS:,}): pass the decision the read makes "
                "yourself (nn.Transformer's tgt_is_causal=True / src_is_causal=True, nn.TransformerEncoder's "
                "is_causal=True with the causal mask), or capture at a shorter length.")

    def _after_unknown_write(self, tensors: list, versions: list) -> None:
        """An op on known tensors that was not computed here: whatever it wrote in place is unknown."""
        for t, v in zip(tensors, versions):
            if t._version != v and t in self.known:
                self._forget_storage(self.known[t][0])


def _leaves(x: Any) -> list:
    """The leaves of nested tuples, lists and dicts (pytree's, without its cost on every call)."""
    out: list = []
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, (tuple, list)) and not isinstance(y, torch.Size):
            stack.extend(reversed(y))
        elif isinstance(y, dict):
            stack.extend(reversed(list(y.values())))
        else:
            out.append(y)
    return out


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - no storage to name
        return 0


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in t.shape)
