"""Which communication of a step hides behind compute, and how much of it still shows.

Four switches, each a plan knob of the same name (``nns.plan(..., tp_comm_overlap=True)``, or
``plan.knobs.tp_comm_overlap``; None: the cluster's) that overrides the cluster's default (`Efficiency`, i.e. the software stack a
preset assumes):

- ``tp_comm_overlap``: tensor-parallel collectives split into chunks and pipelined with the matmul
  next to them (Megatron-Core's tp-comm-overlap, PyTorch's async TP). A ring over t devices cannot
  start computing before its first chunk arrives, so 1/t of the communication stays exposed; the rest
  hides behind the stage's compute of the same pass, up to that compute's length, and slows it by
  the overlap factor kappa. THIS RUNTIME DOES NOT DO IT: its generated code runs tensor-parallel
  collectives synchronously (over gloo they share the CPU cores with compute; on NCCL the chunked
  kernels are not written). A plan with it on is priced as the stacks that do, and `simulate` says so in
  `Estimate.details["not_run_as_priced"]`.
- ``overlap_grad_reduce``: gradients reduced (or reduce-scattered) in buckets as the last backward
  produces them (DDP, Megatron's overlap-grad-reduce, FSDP). The runtime does this
  (`runtime/grad_reducer.py`: async bucketed all-reduce / reduce-scatter from backward hooks, waited
  for at the end of the step; in the pipeline executor the last backward's buckets start while the
  next tasks run). Off: the reduction runs after the backward, and so does the runtime's (its reducer
  then starts every bucket when the backward ends).
- ``overlap_param_gather``: ZeRO's weight all-gathers hidden under compute: ZeRO-3 gathers the next
  weights while the current ones compute (prefetch); ZeRO-1/2 gather the updated weights during the
  next step's first forward (Megatron's overlap-param-gather) instead of after the optimizer step.
  The runtime does it for ZeRO-3 (`runtime/zero.py` launches the next weight's all-gather
  asynchronously while the current one computes, forward and backward) but gathers ZeRO-1/2 weights
  right after the optimizer step, so for ZeRO-1/2 plans it runs as "off" (and `simulate` says so).
- ``overlap_p2p``: pipeline sends and receives asynchronous, beside compute (the runtime's pipeline
  executor posts them with batch_isend_irecv and waits only when the data is needed). Off: the sender
  also waits for each transfer. The runtime always sends asynchronously (a blocking send before its
  peer posts the receive can deadlock a schedule), so "off" is priced but not run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

OPTIONS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "overlap_p2p")
# What this repository's runtime does with each switch (for messages and `Estimate.details`); the last is the
# stack's `Efficiency.tp_backward_overlap` (not a plan option): backward tensor-parallel collectives beside the
# weight-gradient matmuls.
RUNTIME_DOES = {"tp_comm_overlap": False, "overlap_grad_reduce": True, "overlap_param_gather": True,
                "overlap_p2p": True, "tp_backward_overlap": False}  # overlap_grad_reduce both ways; p2p only "on"


@dataclass(frozen=True)
class Overlap:
    tp_comm: bool = False
    grad_reduce: bool = True
    param_gather: bool = True
    p2p: bool = True
    kappa: Optional[float] = 1.15  # slowdown of overlapped compute and communication; None: they cannot overlap
    tp_backward: bool = False  # backward tensor-parallel collectives beside the weight-gradient matmuls

    @classmethod
    def of(cls, options: Mapping[str, Any], cluster) -> "Overlap":
        eff = cluster.efficiency
        kappa = eff.overlap_slowdown if eff.comm_overlap else None

        def pick(name: str) -> bool:
            v = options.get(name)
            return bool(getattr(eff, name)) if v is None else bool(v)

        if kappa is None:  # communication on the compute cores: nothing hides
            return cls(False, False, False, False, None)
        # a plan that asks for its tensor-parallel collectives not overlapped (tp_comm_overlap=False, as
        # this runtime runs them) gets none of the stack's backward overlap either
        backward = bool(eff.tp_backward_overlap) and options.get("tp_comm_overlap") is not False
        return cls(pick("tp_comm_overlap"), pick("overlap_grad_reduce"), pick("overlap_param_gather"),
                   pick("overlap_p2p"), kappa, backward)

    def tp_exposed(self, comm: float, compute: float, ways: int) -> float:
        """Time tensor-parallel communication `comm` adds to a pass whose compute takes `compute`."""
        if comm <= 0.0:
            return 0.0
        if not self.tp_comm or self.kappa is None:
            return comm
        first = comm / max(ways, 1)
        rest = comm - first
        hidden = min(rest, compute)
        return first + (rest - hidden) + (self.kappa - 1.0) * hidden

    def hidden_behind(self, comm: float, window: float) -> float:
        """Extra time of `comm` overlapped with a compute `window` (bounded by it), kappa on the overlap."""
        if comm <= 0.0:
            return 0.0
        if self.kappa is None:
            return comm
        return max(0.0, comm - window) + (self.kappa - 1.0) * min(comm, window)


def not_run_as_priced(options: Mapping[str, Any], cluster, zero: int = 0, tp: bool = True) -> list[str]:
    """The switches a plan is priced with that this runtime does not do (empty when it runs as priced):
    tensor-parallel overlap when the plan has tensor-parallel communication (`tp`), the ZeRO-1/2 weight
    all-gather under the next forward."""
    o = Overlap.of(options, cluster)
    out = []
    if o.tp_comm and tp and not RUNTIME_DOES["tp_comm_overlap"]:
        out.append("tp_comm_overlap")
    elif o.tp_backward and tp and not RUNTIME_DOES["tp_backward_overlap"]:
        out.append("tp_backward_overlap (the stack's)")
    if o.param_gather and zero in (1, 2):
        out.append("overlap_param_gather")
    if not o.p2p and o.kappa is not None:
        out.append("overlap_p2p=False")
    return out
