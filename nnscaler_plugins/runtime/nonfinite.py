"""Non-finite losses and gradients, stopped before they do harm (the plan's `knobs.on_nonfinite`).

Before the optimizer changes any weight, every rank looks at what it holds (the step's loss and
its gradients: one pass over each tensor, on the device; see `nonfinite_flag`) and the ranks agree on one
flag (one all-reduce of two numbers over the world; under plain data parallelism, where every rank
holds the same reduced gradients, only the loss's flag, which rides as one more element on the
gradient reduction the backward starts: `NonFiniteGuard.loss_ready`, `GradReducer.carry`), so all of
them act at the same step:

- "raise": `NonFiniteError` on every rank. Before raising, the ranks re-run the step's forward
  together (no gradients; each collective as in the step) with a check after every statement of
  the generated program, and name the first op, in program order, whose output was not finite,
  with its model source line, micro-batch, stage and rank; when the forward was finite, the
  parameters whose gradients were not.
- "skip": the step is skipped on every rank (the optimizer changes nothing; with a plain torch
  optimizer the gradients are dropped, so it skips every parameter).
- "ignore": no check and no communication (what training did before the knob existed).

fp16 keeps its own rule: the loss scaler skips a step whose gradients overflowed and lowers the
scale (runtime/precision.py); that is the check there.

The re-run is traced with `sys.settrace` over the generated files only: a statement's output is
looked at when the next line starts, so the cost is paid only after something went wrong.
"""
from __future__ import annotations

import ast
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from nnscaler_plugins.errors import NonFiniteError
from nnscaler_plugins.runtime.flight_recorder import is_generated_file


def nonfinite_flag(tensors: Iterable[Optional[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """A 0-dim float32 on `device`: 1.0 when any of `tensors` holds a NaN or an infinity, else 0.0.
    No copy of the tensors. On CUDA one fused multi-tensor max-abs per device (one kernel launch for
    all of them, no host sync). On the CPU, where the host waits for every op anyway, one fused
    multi-tensor 2-norm screens them all (about three times faster than a min-and-max per tensor,
    and the CPU's infinity-norm is slower still), and only a tensor whose norm is not finite is
    read again with its min and max, because a 2-norm also overflows on finite values above about
    1e19. Exact either way: a NaN propagates through norms, max and min, an infinity makes the norm
    infinite and shows in the max or the min."""
    ts = [t.detach() for t in tensors if t is not None and t.is_floating_point() and t.numel()]
    dev = torch.device("cpu") if device.type == "meta" else device
    if not ts:
        return torch.zeros((), dtype=torch.float32, device=dev)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in ts:
        by_device.setdefault(t.device, []).append(t)
    peaks = []
    for where, group in by_device.items():
        if where.type == "cuda":
            peaks += [n.float().reshape(1).to(dev) for n in torch._foreach_norm(group, math.inf)]
        else:
            finite = torch.isfinite(torch.stack(torch._foreach_norm(group, 2)).float())
            for i in (~finite).nonzero().flatten().tolist():  # non-finite, or finite values whose squares overflowed
                lo, hi = torch.aminmax(group[i])
                peaks.append(torch.stack([lo, hi]).float().to(dev))
    if not peaks:
        return torch.zeros((), dtype=torch.float32, device=dev)
    return (~torch.isfinite(torch.cat(peaks))).any().float()


def _many_ranks() -> bool:
    """Whether this process is one of several in a process group (else nothing to agree with)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(flag: torch.Tensor) -> bool:
    """Whether any rank's flag is set (collective over the world; no communication in one process)."""
    if _many_ranks():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# -- finding the first non-finite op -------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """The first non-finite statement output one rank saw while re-running the forward."""

    micro_batch: int
    stage: int
    index: int  # the statement's position in its stage's program
    value: str  # the generated code's variable
    what: str  # "nan", "inf" or "nan and inf"
    op: str  # the op it computes, with module path and source line
    source_code: str
    rank: int

    def order(self) -> tuple[int, int, int, int]:
        return (self.micro_batch, self.stage, self.index, self.rank)

    def describe(self) -> str:
        code = f" `{self.source_code}`" if self.source_code else ""
        return (f"op {self.op}{code} (its output {self.value} holds {self.what}; micro-batch {self.micro_batch}, "
                f"stage {self.stage}, rank {self.rank})")


def _kind(t: torch.Tensor) -> Optional[str]:
    if not t.is_floating_point() or not t.numel():
        return None
    t = t.detach()
    nan, inf = bool(torch.isnan(t).any()), bool(torch.isinf(t).any())
    if not (nan or inf):
        return None
    return "nan and inf" if nan and inf else ("nan" if nan else "inf")


def _assignments(path: str) -> dict[int, list[str]]:
    """Line number -> the names an assignment on that line binds, for a generated file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out: dict[int, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            names = []
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names.append(n.id)
            out.setdefault(node.lineno, []).extend(names)
    return out


class StatementTracer:
    """Looks at every value the generated code binds, statement by statement, while `run()` runs
    under it; keeps the first non-finite one (where: `position()` says the micro-batch and stage)."""

    def __init__(self, describe: Callable[[str, int], Optional[tuple[int, str, str]]],
                 position: Callable[[], tuple[int, int]], rank: int):
        self._lines: dict[str, Optional[dict[int, list[str]]]] = {}  # file -> its assignments (None: not generated)
        self._describe = describe  # (value, stage) -> (statement index, op, source code) or None
        self._position = position
        self._rank = rank
        self.found: Optional[Found] = None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if self.found is not None:
            return None
        if event in ("line", "return"):
            prev = self._prev.get(id(frame))
            if prev is not None:
                self._check(frame, prev)
            self._prev[id(frame)] = frame.f_lineno if event == "line" else None
        return self._local

    def _check(self, frame: Any, line: int) -> None:
        names = (self._lines.get(frame.f_code.co_filename) or {}).get(line, ())
        values = frame.f_locals
        for name in names:
            v = values.get(name)
            if isinstance(v, torch.Tensor):
                what = _kind(v)
                if what is not None:
                    mb, stage = self._position()
                    info = self._describe(name, stage) or (-1, name, "")
                    self.found = Found(mb, stage, info[0], name, what, info[1], info[2], self._rank)
                    return

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or self.found is not None:
            return None
        name = frame.f_code.co_filename
        if name not in self._lines:
            self._lines[name] = _assignments(name) if is_generated_file(name) else None
        return self._local if self._lines[name] is not None else None

    def run(self, fn: Callable[[], Any]) -> Any:
        self._prev: dict[int, Optional[int]] = {}
        old = sys.gettrace()
        sys.settrace(self._global)
        try:
            return fn()
        finally:
            sys.settrace(old)


class ModuleTracer:
    """`StatementTracer` for a model whose own forward runs (the eager executor): looks at every
    module's output as it returns while `run()` runs under it, and keeps the first non-finite one, named
    by the module's path, its class and where its forward is defined."""

    def __init__(self, model: torch.nn.Module, position: Callable[[], tuple[int, int]], rank: int):
        self._model = model
        self._position = position
        self._rank = rank
        self._returned = 0  # modules returned so far in this run: the order of their outputs
        self.found: Optional[Found] = None

    def _hook(self, path: str) -> Callable[..., None]:
        def look(module: torch.nn.Module, args: Any, out: Any) -> None:
            self._returned += 1
            if self.found is not None:
                return
            for t in (x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)):
                what = _kind(t)
                if what is not None:
                    mb, stage = self._position()
                    self.found = Found(mb, stage, self._returned, f"the output of {path or 'the model'}", what,
                                       f"{path or '<the model>'} ({type(module).__name__}) at {_defined_at(module)}",
                                       "", self._rank)
                    return
        return look

    def run(self, fn: Callable[[], Any]) -> Any:
        self._returned = 0
        hooks = [m.register_forward_hook(self._hook(path)) for path, m in self._model.named_modules()]
        try:
            return fn()
        finally:
            for h in hooks:
                h.remove()


def _defined_at(module: torch.nn.Module) -> str:
    """Where a module's forward is written ("file.py:12"), for messages."""
    import inspect

    try:
        fn = type(module).forward
        return f"{os.path.basename(inspect.getsourcefile(fn) or '?')}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return type(module).__module__


def statement_index(program: Any, unit_device: int) -> Callable[[str, int], Optional[tuple[int, str, str]]]:
    """(generated variable, stage) -> (statement index, the op in words, its source code) for this
    device's program."""
    table: dict[tuple[str, int], tuple[int, str, str]] = {}
    for stage, sp in program.ranks[unit_device].stages.items():
        for i, stmt in enumerate(sp.stmts):
            for name in stmt.out or ():
                op = stmt.op
                where = op.where() if op is not None else name
                code = getattr(op, "source_code", "") or ""
                table.setdefault((name, stage), (i, where if stmt.kind == "op" else
                                                 f"{stmt.kind} {stmt.comment or ''} for {where}".strip(), code))
    return lambda name, stage: table.get((name, stage))


def first_nonfinite(found: Optional[Found]) -> Optional[Found]:
    """The first, in program order, of every rank's find (collective over the world)."""
    everyone: list[Optional[Found]] = [found]
    if _many_ranks():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
    hits = [f for f in everyone if f is not None]
    return min(hits, key=Found.order) if hits else None


def bad_gradients(named: Iterable[tuple[str, Optional[torch.Tensor]]]) -> list[str]:
    """Names of the gradients here that hold a NaN or an infinity, with what they hold."""
    out = []
    for name, g in named:
        if g is not None:
            what = _kind(g)
            if what is not None:
                out.append(f"{name} ({what})")
    return out


def all_bad_gradients(mine: list[str]) -> list[str]:
    """Every rank's `bad_gradients`, each name once, with the ranks that hold it (collective)."""
    everyone: list[list[str]] = [mine]
    if _many_ranks():
        everyone = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    ranks: dict[str, list[int]] = {}
    for r, names in enumerate(everyone):
        for n in names:
            ranks.setdefault(n, []).append(r)
    return [f"{n} on rank(s) {rs}" for n, rs in ranks.items()]


def raise_nonfinite(step: int, where: str, found: Optional[Found], gradients: list[str], loss_bad: bool,
                    searched: bool) -> None:
    """Raise the NonFiniteError every rank raises alike."""
    what = "loss" if loss_bad and not gradients else ("loss and gradients" if loss_bad else "gradients")
    lines = [f"step {step}: non-finite {what} (NaN or infinity) on some rank; {where} stopped on every rank before "
             "the optimizer changed any weight."]
    if found is not None:
        lines.append(f"The first non-finite output in program order: {found.describe()}.")
    elif searched:
        lines.append("Re-running the step's forward found every op's output finite: the non-finite values arose in "
                     "the backward.")
    if gradients:
        lines.append("Non-finite gradients: " + "; ".join(gradients[:8]) + (" ..." if len(gradients) > 8 else "") + ".")
    lines.append("Look at that op's inputs (the batch, a learning rate too high, a log or division at 0); "
                 "on_nonfinite='skip' skips such steps instead, on_nonfinite='ignore' trains on.")
    raise NonFiniteError(" ".join(lines[:1]) + "\n  " + "\n  ".join(lines[1:]), step=step,
                         op=None if found is None else found.op, rank=None if found is None else found.rank,
                         gradients=tuple(gradients))


class NonFiniteGuard:
    """A ParallelModule's check of each step (see the module docstring): `check` is called once per
    step, before any weight changes, by the optimizer `nns.build_optimizer` made, or by `train_step`
    itself when no such optimizer exists. `last_loss` is the loss `train_step` last returned."""

    def __init__(self, module: Any):
        self.module = module
        self.steps = 0
        self.last_loss: Optional[torch.Tensor] = None
        # the loss's flag agreed early (`loss_ready`): the flag and its all-reduce in flight
        self._loss_flag: Optional[tuple[torch.Tensor, Any]] = None

    @property
    def mode(self) -> str:
        return self.module.plan.knobs.on_nonfinite

    def _device(self) -> torch.device:
        dev = self.module.device
        return dev if dev.type != "meta" else torch.device("cpu")

    def loss_ready(self, loss: torch.Tensor) -> None:
        """The step's loss, once its last forward ran and before its backward (collective: every
        rank calls it). Where the plan leaves every rank the same gradients
        (`ParallelModule.gradients_alike_by_plan`), their flag needs no communication, so the
        loss's flag is handed to the gradient reduction the backward starts, which sums it over the
        ranks with the first bucket, and `check` communicates nothing.
        Elsewhere, and under fp16 (whose loss scaler has its own rule), nothing happens here."""
        if self.mode == "ignore" or self.module.plan.precision == "fp16" or not self.module.gradients_alike_by_plan():
            return
        self._settle_loss_flag()  # one left by a step that was never checked
        flag = nonfinite_flag([loss], self._device()).reshape(1)
        work = None
        if _many_ranks():
            # the flag rides on the gradient reduction the backward starts: no collective of its own
            self.module.grad_reducer.carry(flag)
            work = self.module.grad_reducer
        self._loss_flag = (flag, work)

    def _settle_loss_flag(self) -> Optional[torch.Tensor]:
        """The loss flag agreed by `loss_ready` (> 0 when any rank's loss was not finite), or None;
        forgotten once read. One the reduction could not carry is agreed on here."""
        if self._loss_flag is None:
            return None
        (flag, reducer), self._loss_flag = self._loss_flag, None
        if reducer is None:
            return flag[0]
        agreed = reducer.carried()
        if agreed is None:  # the same on every rank: no reduction carried it
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return flag[0]
        return agreed[0]

    def check(self, gradients: Sequence[tuple[str, Optional[torch.Tensor]]], where: str) -> bool:
        """Collective over the world (every rank calls it at the same point of the step). True when
        the step must be skipped; raises NonFiniteError in "raise" mode."""
        if self.mode == "ignore":
            return False
        self.steps += 1
        module = self.module
        dev = self._device()
        loss, self.last_loss = self.last_loss, None
        early = self._settle_loss_flag()
        grad_flag = nonfinite_flag([g for _, g in gradients], dev)
        if early is not None and module.gradients_alike():
            # every rank holds the same gradients, so the same flag; the loss's was agreed behind backward
            flags = torch.stack([grad_flag, early])
        else:
            flags = torch.stack([grad_flag, nonfinite_flag([loss], dev)])
            if _many_ranks():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        grad_bad, loss_bad = (bool(x) for x in flags.tolist())
        if not (grad_bad or loss_bad):
            return False
        if self.mode == "skip":
            return True
        found, searched = None, False
        rec = module.flight_recorder
        eager = getattr(module, "eager", None)
        tracer = ModuleTracer(eager.model, lambda: (rec.micro_batch, rec.stage), module.rank) if eager is not None \
            else StatementTracer(statement_index(module.program, module.unit_device),
                                 lambda: (rec.micro_batch, rec.stage), module.rank)
        searched = module.replay_last_forward(tracer.run)
        found = first_nonfinite(tracer.found)
        raise_nonfinite(self.steps, where, found, all_bad_gradients(bad_gradients(gradients)), loss_bad, searched)
        return True  # not reached
