"""The pipeline executor: runs this device's task list of one training step.

The task lists come from the plan's schedule and passed the dry run (`timeline.check`) before any
process started, so following them in order cannot deadlock: every receive a task waits on is
matched by a send an earlier task (on another rank) posts. A task's sends are posted together as
one batch of asynchronous point-to-point ops, waited for at the end of the step; its receives are
posted as one batch just before it runs, and waited for there.

Boundary values cross stages whole: device j of the receiving stage gets the value from device
j mod |sender| of the sending stage, and gradients travel back the same way, one per consumer
stage, summed on arrival. Values passed between two stages of one device (interleaved chunks) go
through a local mailbox instead of the network.

In bf16/fp16 each stage runs under autocast, like the whole-model forward, and floating-point
boundary values travel in the compute dtype (half the bytes, as Megatron sends them); a gradient
arriving for a stage output is cast to that output's dtype before backward. Under ZeRO-3 a stage's
parameters are gathered one by one as its code reads them and dropped after; the backward gathers
them again and reduce-scatters each micro-batch's gradients among the stage's replicas (which run
the same task list, so their collectives match), waited for before this device's next backward
task. Gradients summed across stages (a tied embedding) are reduced once, after the last task.

Memory is measured, not assumed: every tensor autograd saves for backward is counted against its
micro-batch until that micro-batch's backward (or weight-gradient task) is done; the peak is kept
in `peak_saved_bytes` and the most micro-batches held at once in `peak_in_flight`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.plan.schedules import BACKWARD, FORWARD, Task
from nnscaler_plugins.kernels.collectives import pack_saved, saved_bytes, unpack_saved
from nnscaler_plugins.runtime.flight_recorder import OUTSIDE
from nnscaler_plugins.runtime.precision import autocast, compute_dtype
from nnscaler_plugins.runtime.split_backward import SplitBackward

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program
    from nnscaler_plugins.runtime.zero import Zero3Params


@dataclass
class StageRuntime:
    """All the executor reads of the module it runs for (`ParallelModule` makes one)."""

    program: Program  # the plan (its pipeline's task lists, precision), stage inputs and sends, boundaries
    unit_device: int  # this device, numbered inside its unit
    global_rank: Callable[[int], int]  # a unit device -> the global rank of it in this replica
    generated: Callable[[int], Any]  # micro-batch -> its ShapeProgram: the generated module (`stage{k}`, `stage{k}_loss`) and its Program
    comm: Any  # what the generated code calls for communication (`runtime/comm.py`)
    device: torch.device  # where stage functions run and received values land
    params_on_use: Callable[[int], Any]  # stage k's `_P` (`runtime/params_on_use.py`)
    stage_parameters: Callable[[int], list[torch.nn.Parameter]]  # what stage k's weight pass differentiates
    zero3: Optional[Zero3Params]  # ZeRO-3's gathered parameters and gradient reduce-scatters, if any
    loss_scale: Callable[[], float]  # read at each loss backward (the optimizer moves it in fp16)
    boundary_shape: Callable[[str, int], tuple[int, ...]]  # (boundary value, micro-batch) -> its whole shape
    micro_weight: Callable[[int], float]  # a micro-batch's share of the step's loss
    recorder: Any = None  # the flight recorder (runtime/flight_recorder.py): each task is a position


@dataclass
class _InFlight:
    """What a forward keeps for its backward."""

    leaves: list[tuple[str, torch.Tensor]]  # boundary inputs that need a gradient
    sent: list[tuple[str, torch.Tensor]]  # boundary outputs whose gradient comes back
    loss: Optional[torch.Tensor]
    saved_bytes: int = 0
    split: Optional[SplitBackward] = None


@dataclass
class _Incoming:
    """A tensor on its way: ready when `op` (a posted receive) completes, or at once from the mailbox."""

    tensor: torch.Tensor
    op: Optional[Any]


@dataclass
class StepStats:
    peak_in_flight: int = 0
    peak_saved_bytes: int = 0
    tasks_run: list[str] = field(default_factory=list)


class PipelineExecutor:
    def __init__(self, runtime: StageRuntime):
        self.rt = runtime
        program = runtime.program
        self.program = program
        self.spec = program.plan.pipeline
        self.precision = program.plan.precision
        self.device = runtime.unit_device
        self.my_stages = sorted(program.ranks[self.device].stages)
        self.pipeline_rank = self.spec.rank_of_device(self.device)
        self.tasks: list[Task] = self.spec.task_lists()[self.pipeline_rank]
        self.groups = program.stage_groups
        self.input_index = {spec.name: i for i, spec in enumerate(program.graph.inputs)}
        self.loss_index = program.loss_index
        self.loss_stage = program.output_stage[self.loss_index] if self.loss_index is not None else None
        self.boundary = {b.value: b for b in program.boundaries}
        # A tag per (value, consumer stage, direction); micro-batch and round are folded in per step.
        self._channels: dict[tuple[str, int, int], int] = {}
        for b in program.boundaries:
            for k in b.dsts:
                for direction in (0, 1):
                    self._channels[(b.value, k, direction)] = len(self._channels)
        self._rounds = 1 + max((t.round for ts in self.spec.task_lists() for t in ts), default=0)
        self.stats = StepStats()
        self._half = compute_dtype(self.precision) if self.precision != "fp32" else None
        if runtime.zero3 is not None:
            runtime.zero3.in_pipeline = True
        # what the weight pass of a split backward differentiates (the module's Parameters do not change)
        self._stage_params = {s: runtime.stage_parameters(s) for s in self.my_stages} \
            if self.spec.split_backward else {}

    # -- addressing ---------------------------------------------------------------------------------------
    def _global(self, unit_device: int) -> int:
        return self.rt.global_rank(unit_device)

    def _tag(self, value: str, consumer: int, direction: int, mb: int, rnd: int) -> int:
        channel = self._channels[(value, consumer, direction)]
        return (channel * self.spec.micro_batches + mb) * self._rounds + rnd

    @staticmethod
    def _pick(senders: tuple[int, ...], receivers: tuple[int, ...], receiver: int) -> int:
        """Who sends a whole value to `receiver`: itself when it holds it, else senders in turn."""
        if receiver in senders:
            return receiver
        return senders[receivers.index(receiver) % len(senders)]

    # -- communication -------------------------------------------------------------------------------------
    # A task's transfers are gathered and posted together as one batch of point-to-point ops;
    # transfers between two stages of this device go through the mailbox.
    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What a boundary value (or its gradient) of this dtype travels as."""
        return self._half if self._half is not None and dtype.is_floating_point else dtype

    def _send(self, t: torch.Tensor, dst: int, tag: int, key: tuple) -> None:
        t = t.to(self._wire_dtype(t.dtype))
        if dst == self.device:
            self._mailbox[key] = t
        else:
            payload = t.contiguous()
            self._outbox.append(dist.P2POp(dist.isend, payload, self._global(dst), tag=tag))

    def _flush_sends(self) -> None:
        if self._outbox:
            works = dist.batch_isend_irecv(self._outbox)
            self._pending += [(w, op.tensor) for w, op in zip(works, self._outbox)]
            self._outbox = []

    def _recv(self, src: int, meta_of: str, mb: int, tag: int, key: tuple) -> "_Incoming":
        if src == self.device:
            return _Incoming(self._mailbox.pop(key), None)
        meta = self.program.graph.meta(meta_of)
        buf = torch.empty(self.rt.boundary_shape(meta_of, mb), dtype=self._wire_dtype(meta.dtype),
                          device=self.rt.device)
        return _Incoming(buf, dist.P2POp(dist.irecv, buf, self._global(src), tag=tag))

    def _wait(self, incoming: list["_Incoming"]) -> None:
        ops = [i.op for i in incoming if i.op is not None]
        if ops:
            rec = self.rt.recorder
            if rec is not None:
                rec.enter(OUTSIDE, f"pipeline receive from rank(s) {sorted({op.peer for op in ops})}")
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if rec is not None:
                rec.leave()

    def _send_forward(self, value: str, stage: int, t: torch.Tensor, mb: int, rnd: int) -> None:
        b = self.boundary[value]
        src_group = self.groups[stage]
        payload = t.detach()
        for k in b.dsts:
            for dst in self.groups[k]:
                if self._pick(src_group, self.groups[k], dst) == self.device:
                    self._send(payload, dst, self._tag(value, k, 0, mb, rnd), ("f", value, k, mb, rnd, dst))

    def _recv_forward(self, value: str, stage: int, mb: int, rnd: int) -> "_Incoming":
        b = self.boundary[value]
        src = self._pick(self.groups[b.src], self.groups[stage], self.device)
        return self._recv(src, value, mb, self._tag(value, stage, 0, mb, rnd),
                          ("f", value, stage, mb, rnd, self.device))

    def _send_backward(self, value: str, stage: int, grad: torch.Tensor, mb: int) -> None:
        b = self.boundary[value]
        for dst in self.groups[b.src]:
            if self._pick(self.groups[stage], self.groups[b.src], dst) == self.device:
                self._send(grad, dst, self._tag(value, stage, 1, mb, 0), ("b", value, stage, mb, dst))

    def _recv_backward(self, value: str, mb: int) -> list["_Incoming"]:
        """One incoming gradient per consumer stage; the caller sums them once they arrived."""
        b = self.boundary[value]
        out = []
        for k in b.dsts:
            src = self._pick(self.groups[k], self.groups[b.src], self.device)
            out.append(self._recv(src, value, mb, self._tag(value, k, 1, mb, 0), ("b", value, k, mb, self.device)))
        return out

    # -- tasks ----------------------------------------------------------------------------------------------
    def _forward(self, task: Task, inputs: list[list[Any]]) -> None:
        s, mb = task.stage, task.micro_batch
        names = self.program.stage_inputs[s]
        incoming = {name: self._recv_forward(name, s, mb, task.round) for name in names
                    if name not in self.input_index}
        self._wait(list(incoming.values()))
        ins, leaves = [], []
        for name in names:
            if name in self.input_index:
                ins.append(inputs[mb][self.input_index[name]])
                continue
            t = incoming[name].tensor
            if task.grad and self.boundary[name].requires_grad:
                t.requires_grad_(True)
                leaves.append((name, t))
            ins.append(t)
        loss_here = self.loss_stage == s
        generated = self.rt.generated(mb)
        fn = getattr(generated.module, f"stage{s}_loss" if loss_here and self.loss_index is not None else f"stage{s}")
        saved = [0]

        def count(packed: Any) -> None:
            saved[0] += saved_bytes(packed)

        def pack(t: torch.Tensor) -> Any:
            packed = pack_saved(t)
            count(packed)
            return packed

        rt = self.rt
        if not task.grad:
            hooks = contextlib.nullcontext()
        elif rt.zero3 is not None:  # its hooks swap gathered parameters for references; it counts the rest
            hooks = rt.zero3.forward_scope(on_save=count)
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved)
        with torch.set_grad_enabled(task.grad), hooks, autocast(self.precision, rt.device):
            outs = fn(rt.comm.for_program(generated.program), rt.device, rt.params_on_use(s), *ins)
        sends = self.program.stage_sends[s]
        for value, t in zip(sends, outs[:len(sends)]):
            self._send_forward(value, s, t, mb, task.round)
        self._flush_sends()
        if not task.grad:
            return
        loss = outs[len(sends) + self.loss_index] if loss_here else None
        if loss is not None:
            self._loss_sum = self._loss_sum + loss.detach() * self.rt.micro_weight(mb)
        sent = [(v, t) for v, t in zip(sends, outs[:len(sends)])
                if self.boundary[v].requires_grad and t.requires_grad]
        self._in_flight[(s, mb)] = _InFlight(leaves, sent, loss, saved[0])
        self._account()

    def _account(self) -> None:
        held = list(self._in_flight.values())
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(held))
        self.stats.peak_saved_bytes = max(self.stats.peak_saved_bytes, sum(h.saved_bytes for h in held))

    def _roots(self, state: _InFlight, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        incoming = [self._recv_backward(value, mb) for value, _ in state.sent]
        self._wait([i for parts in incoming for i in parts])
        roots, grads = [], []
        for (value, t), parts in zip(state.sent, incoming):
            roots.append(t)
            total = parts[0].tensor
            for extra in parts[1:]:
                total = total + extra.tensor
            grads.append(total.to(t.dtype))
        if state.loss is not None:  # the loss scale (fp16) is applied here, as train_step does without stages
            roots.append(state.loss)
            grads.append(torch.full_like(state.loss, self.rt.loss_scale() * self.rt.micro_weight(mb)))
        return roots, grads

    def _backward(self, task: Task) -> None:
        s, mb = task.stage, task.micro_batch
        state = self._in_flight[(s, mb)]
        roots, grads = self._roots(state, mb)
        leaves = [t for _, t in state.leaves]
        if self.spec.split_backward:
            state.split = SplitBackward(roots, grads, leaves, self._stage_params[s])
            state.split.inputs()
        elif roots:
            torch.autograd.backward(roots, grads)
        for value, leaf in state.leaves:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self._send_backward(value, s, grad, mb)
        self._flush_sends()
        if not self.spec.split_backward:
            del self._in_flight[(s, mb)]

    def _weight(self, task: Task) -> None:
        state = self._in_flight.pop((task.stage, task.micro_batch))
        if state.split is not None:
            state.split.weights()

    # -- the step ---------------------------------------------------------------------------------------------
    def run(self, inputs: list[list[Any]]) -> torch.Tensor:
        """One training step over the micro-batches (each a list of graph-input values)."""
        if len(inputs) != self.spec.micro_batches:
            raise ValueError(f"the plan's pipeline takes {self.spec.micro_batches} micro-batches, got {len(inputs)}")
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._outbox: list[Any] = []
        self._mailbox: dict[tuple, torch.Tensor] = {}
        self._in_flight: dict[tuple[int, int], _InFlight] = {}
        self._loss_sum = torch.zeros((), device=self.rt.device)
        self.stats = StepStats()
        z = self.rt.zero3
        reduce = z is not None and z.sync  # not inside the user's no_sync()
        rec = self.rt.recorder
        for task in self.tasks:
            if rec is not None:
                rec.at(task.kind, task.stage, task.micro_batch)
            if task.kind == FORWARD:
                self._forward(task, inputs)
            else:
                if reduce:  # the previous backward's reduce-scatters: at most one backward's in flight
                    z.settle()
                if task.kind == BACKWARD:
                    self._backward(task)
                else:
                    self._weight(task)
                if reduce:  # this backward's last bucket starts now, overlapping the next tasks
                    z.flush()
            self.stats.tasks_run.append(str(task))
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        if reduce:
            z.reduce_across_stages()
            z.finish()
        if self._in_flight or self._mailbox:
            raise RuntimeError(f"pipeline step ended with work left: {sorted(self._in_flight)} "
                               f"{sorted(self._mailbox)}")
        return self._loss_sum

    def forward_only(self, inputs: list[list[Any]]) -> None:
        """Every micro-batch's forward through this device's stages again, without gradients (the
        non-finite check's re-run): micro-batch by micro-batch, stages in order, so each receive is
        matched by a send an earlier forward posted. Collective over the pipeline like `run`."""
        self._pending, self._outbox, self._mailbox, self._in_flight = [], [], {}, {}
        self._loss_sum = torch.zeros((), device=self.rt.device)
        rec = self.rt.recorder
        for mb in range(len(inputs)):
            for s in self.my_stages:
                if rec is not None:
                    rec.at("re-run", s, mb)
                self._forward(Task(s, mb, FORWARD, grad=False), inputs)
        for work, _ in self._pending:
            work.wait()
        self._pending, self._mailbox = [], {}
