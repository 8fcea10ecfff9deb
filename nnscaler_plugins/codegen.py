"""Codegen: a Program's rank becomes one plain Python file, one statement per op.

The file is what runs: the runtime imports it. Each op statement carries a comment with the model's
source line, so a reader can map every line back to their model. Files are cached under a key
that covers everything they depend on (graph, model source, plan, library and torch versions); a
changed model gets a new directory instead of a stale file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
from typing import Any, Optional

import torch

from .graph import Ref
from .lowering import Program, RankProgram, Stmt

GENERATOR_VERSION = "1"


def library_version() -> str:
    try:
        from importlib.metadata import version
        return version("nnscaler-plugins")
    except Exception:
        return "dev"


def cache_key(program: Program) -> str:
    h = hashlib.sha256()
    h.update(program.graph.fingerprint().encode())
    h.update(program.graph.source_hash.encode())
    h.update(json.dumps(program.plan.to_json(), sort_keys=True, default=str).encode())
    h.update(f"{library_version()}|{GENERATOR_VERSION}|{torch.__version__}".encode())
    return h.hexdigest()[:20]


class _Emitter:
    def __init__(self) -> None:
        self.imports: dict[str, str] = {}  # module -> alias

    def callable_name(self, fn: Any) -> str:
        if isinstance(fn, torch._ops.OpOverload):
            ns = fn.namespace
            name = fn._schema.name.split("::", 1)[1]
            return f"torch.ops.{ns}.{name}.{fn._overloadname}" if ns != "aten" else f"aten.{name}.{fn._overloadname}"
        if isinstance(fn, torch._ops.OpOverloadPacket):
            return f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
        mod = getattr(fn, "__module__", None)
        qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        if not mod or not qual or "<" in qual:
            raise TypeError(f"cannot emit a call to {fn!r}: not an importable function")
        if mod == "builtins":
            return qual
        alias = self.imports.setdefault(mod, "_m%d" % len(self.imports))
        return f"{alias}.{qual}"

    def value(self, x: Any) -> str:
        if isinstance(x, Ref):
            return x.name
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self.value(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else (f"({inner},)" if len(x) == 1 else f"({inner})")
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {self.value(v)}" for k, v in x.items()) + "}"
        if isinstance(x, torch.dtype):
            return str(x)
        if isinstance(x, torch.device):
            return "_device"  # generated code runs on whatever device the module lives on
        if isinstance(x, torch.layout):
            return str(x)
        if isinstance(x, torch.memory_format):
            return str(x)
        if isinstance(x, float):
            if math.isinf(x) or math.isnan(x):
                return f"float({str(x)!r})"
            return repr(x)
        if isinstance(x, (int, bool, str)) or x is None:
            return repr(x)
        if isinstance(x, torch.Tensor):
            raise TypeError("tensor constants must be graph values, not literals")
        raise TypeError(f"cannot emit literal of type {type(x).__name__}: {x!r}")


def _last_uses(stmts: list[Stmt], outputs: list[Optional[str]]) -> dict[int, list[str]]:
    """Statement index -> names whose last use is that statement (freed right after)."""
    last: dict[str, int] = {}
    keep = {o for o in outputs if o}

    def uses(s: Stmt) -> list[str]:
        names: list[str] = []
        if s.src:
            names.append(s.src)
        for leaf in torch.utils._pytree.tree_leaves((s.args, s.kwargs)):
            if isinstance(leaf, Ref):
                names.append(leaf.name)
        return names

    for i, s in enumerate(stmts):
        for n in uses(s):
            last[n] = i
    out: dict[int, list[str]] = {}
    for n, i in last.items():
        if n not in keep:
            out.setdefault(i, []).append(n)
    return out


def generate(program: Program, device: int) -> str:
    rp: RankProgram = program.ranks[device]
    em = _Emitter()
    body: list[str] = []
    frees = _last_uses(rp.stmts, rp.outputs)
    no_grad_open = False
    defined = set(rp.inputs) | set(rp.params)
    for i, s in enumerate(rp.stmts):
        ind = "    "
        if s.kind == "op" and not s.grad_enabled:
            if not no_grad_open:
                body.append("    with torch.no_grad():")
                no_grad_open = True
            ind = "        "
        elif no_grad_open:
            no_grad_open = False
        if s.kind == "op" and s.op is not None:
            where = s.op.source or "?"
            code = f": {s.op.source_code}" if s.op.source_code else ""
            mod = f" [{s.op.module_path}]" if s.op.module_path else ""
            body.append(f"{ind}# {where}{mod}{code}"[:160])
            outs = [o if o is not None else "_" for o in s.out]
            lhs = (", ".join(outs) + ("," if len(outs) == 1 else "")) if s.op.multi_output else outs[0]
            args = ", ".join(em.value(a) for a in s.args)
            kw = dict(s.kwargs)
            kws = [f"{k}={em.value(v)}" for k, v in kw.items()]
            if s.group_kwarg is not None:
                kws.append(f"group=_groups.kernel({s.group_kwarg})")
            call = f"{em.callable_name(s.target)}({', '.join([a for a in [args] if a] + kws)})"
            body.append(f"{ind}{lhs} = {call}" if any(o is not None for o in s.out) else f"{ind}{call}")
            defined.update(o for o in s.out if o)
        elif s.kind == "reshard":
            body.append(f"{ind}{s.out[0]} = _groups.reshard({s.key}, {s.src})  # {s.comment}")
        elif s.kind == "grad_sum":
            body.append(f"{ind}{s.out[0]} = _groups.grad_sum({s.key}, {s.src})  # {s.comment}")
        dead = [n for n in frees.get(i, []) if n in defined and n not in rp.params and n not in rp.inputs]
        if dead:
            body.append(f"{ind}del {', '.join(sorted(dead))}")
    outs = ", ".join(o if o is not None else "None" for o in rp.outputs)
    header = [
        f"# Generated by nnscaler-plugins {library_version()} for {program.graph.model_class}: device {device} of a "
        f"{program.unit_size}-device unit (x{program.plan.dp} data-parallel).",
        f"# Plan: {program.plan.strategy} {program.plan.options}; graph {program.graph.fingerprint()}.",
        "# One statement per op of the captured graph; comments name the model's source line.",
        "import torch",
        "aten = torch.ops.aten",
    ]
    header += [f"import {m} as {a}" for m, a in em.imports.items()]
    params = ", ".join(rp.params)
    inputs = ", ".join(rp.inputs)
    sig_args = ", ".join(x for x in ["_groups", "_device", "_P", inputs] if x)
    unpack = f"    {params}{',' if len(rp.params) == 1 else ''} = _P\n" if rp.params else ""
    func = (f"\n\ndef forward({sig_args}):\n"
            f"    # parameters and buffers held on this device, in Program order\n{unpack}"
            + "\n".join(body) + f"\n    return ({outs}{',' if len(rp.outputs) == 1 else ''})\n")
    return "\n".join(header) + func


def write_and_load(program: Program, device: int, cache_dir: str) -> tuple[Any, str]:
    """Generate (or reuse) the rank's file under cache_dir/<key>/ and import its `forward`."""
    key = cache_key(program)
    d = os.path.join(cache_dir, key)
    path = os.path.join(d, f"rank{device}.py")
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        src = generate(program, device)
        fd, tmp = tempfile.mkstemp(prefix=".gen-", dir=d, suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    modname = f"nnscaler_gen_{key}_rank{device}"
    if modname in sys.modules:
        return sys.modules[modname].forward, path
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    sys.modules[modname] = mod
    return mod.forward, path
