"""What context-parallel attention costs on a cluster, per attention call, forward and backward.

The simulator prices ops from their placement; attention split along its sequence runs a kernel
that talks to its group (`runtime.ring_attention`), whose time is not a collective the lowering
inserts. This module gives that time for each `cp_comm`:

- ring: cp steps; step t computes the local queries against one key/value block while the next
  block travels (p2p, overlapped), so a step costs max(compute, transfer) and the first block's
  compute is not hidden behind anything. Backward: cp steps again, each moving the block and its
  two gradient accumulators (twice the forward's bytes in the gradients' dtype, the block too).
  With causal load balancing every device computes 1/cp of the causal work; without it the device
  holding the last chunk computes (2cp-1)/cp^2 of it and every step waits for that device.
- allgather: keys and values gathered once (backward: their gradients reduce-scattered), then the
  local queries' attention at 1/cp of the work (balanced) with no overlap.
- ulysses: four all-to-alls (q, k, v in, the output back; backward the same), each moving
  (cp-1)/cp of a device's piece, around whole-sequence attention over heads / cp.

`attention_seconds` is the whole attention's compute time on one device (the simulator's kernel
table gives it); the function scales it per device.
"""
from __future__ import annotations

from dataclasses import dataclass

from nnscaler_plugins.search.network import Network, Span


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    causal: bool = True
    itemsize: int = 2

    def kv_bytes(self, cp: int) -> float:
        """One device's keys and values."""
        return 2.0 * self.batch * self.kv_heads * self.length / cp * self.head_dim * self.itemsize

    def q_bytes(self, cp: int) -> float:
        return float(self.batch * self.heads * self.length / cp * self.head_dim * self.itemsize)


@dataclass(frozen=True)
class ContextParallelTime:
    forward: float
    backward: float
    exposed_comm: float  # communication not hidden behind compute, forward + backward

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _work_share(cp: int, causal: bool, balanced: bool) -> float:
    """Fraction of the whole attention's work the busiest device computes."""
    if not causal or balanced:
        return 1.0 / cp
    # contiguous chunks: device cp-1 attends to every earlier chunk; whole causal work ~ cp^2 / 2 blocks
    return (2 * cp - 1) / (cp * cp)


def context_parallel_attention_time(net: Network, span: Span, shape: AttentionShape, cp: int, mode: str,
                                    attention_seconds: float, backward_ratio: float = 2.5,
                                    balanced: bool = True) -> ContextParallelTime:
    """Per-device time of one attention call split over a cp group lying as `span`."""
    if cp <= 1:
        return ContextParallelTime(attention_seconds, attention_seconds * backward_ratio, 0.0)
    share = _work_share(cp, shape.causal, balanced)
    fwd_compute = attention_seconds * share
    bwd_compute = fwd_compute * backward_ratio
    if mode == "ring":
        hop = net.p2p(shape.kv_bytes(cp), not span.local)
        step_f, step_b = fwd_compute / cp, bwd_compute / cp
        fwd = step_f + (cp - 1) * max(step_f, hop)
        bwd = step_b + (cp - 1) * max(step_b, 2 * hop) + hop  # last hop: the gradients go home, not hidden
        exposed = (cp - 1) * (max(0.0, hop - step_f) + max(0.0, 2 * hop - step_b)) + hop
        return ContextParallelTime(fwd, bwd, exposed)
    if mode == "allgather":
        gather = net.all_gather(shape.kv_bytes(1), span)
        fwd = gather + fwd_compute
        bwd = gather + bwd_compute  # the reduce-scatter of the key/value gradients moves the same bytes
        return ContextParallelTime(fwd, bwd, 2 * gather)
    if mode == "ulysses":
        per = shape.q_bytes(1) + shape.kv_bytes(1) + shape.q_bytes(1)
        swap = net.all_to_all(per, span)
        fwd = swap + attention_seconds / cp
        bwd = swap + attention_seconds / cp * backward_ratio
        return ContextParallelTime(fwd, bwd, 2 * swap)
    raise ValueError(f"cp_comm {mode!r}: use ring, allgather or ulysses")
