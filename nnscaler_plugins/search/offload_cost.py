"""What a plan's `offload` changes in its price: device memory down by the model states moved to
the host, step time up by the host-device traffic and the optimizer step on the host.

It follows what the runtime does (runtime/optimizer.py, runtime/zero.py), per device and step:

- offload="optimizer": the fp32 masters and the optimizer's moments of the parameters the device
  owns live in host memory (the device saves its whole "optimizer" states). After backward the
  owned gradients are copied to the host, the step runs there (it streams masters, moments and
  gradients through the host's memory bandwidth, shared by the node's devices), and the updated
  parameters are copied back. Nothing of it overlaps: the step needs every gradient, the next
  forward needs the updated weights, and the runtime copies gradients once backward is over.
- offload="params" (ZeRO-3): the owned parameter chunks and their gradients live there too (the
  device saves its "params" and "grads" states as well); there is no upload after the step, but
  every gather copies the chunk to the device first: forward and backward, each micro-batch.
  Those copies run just before their gather, which the runtime prefetches; they are priced as
  not overlapped, like the gathers' own time on the same path would be without a prefetch.

The device's own optimizer step, already in the step time, is taken out again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nnscaler_plugins.errors import PlanError

# Bytes a host AdamW step streams per parameter: the fp32 master read and written, two fp32
# moments read and written, the fp32 gradient read.
_HOST_STEP_BYTES = 4 * 2 + 8 * 2 + 4


@dataclass(frozen=True)
class OffloadPrice:
    """Per device: bytes moved from device to host memory, bytes held in host memory, and the
    seconds added to one step (host work and transfers, less the device's own optimizer step)."""

    device_bytes_saved: float = 0.0
    host_bytes: float = 0.0
    seconds: float = 0.0
    transfer_s: float = 0.0
    host_step_s: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"device_bytes_saved": self.device_bytes_saved, "host_bytes": self.host_bytes,
                "seconds": self.seconds, "transfer_s": self.transfer_s, "host_step_s": self.host_step_s}


def _rates(cluster: Any) -> tuple[float, float]:
    """(host-device bytes/s per device, host memory bytes/s per device)."""
    on_cpu = "cpu" in str(cluster.device).lower()
    link = cluster.host_bandwidth or (cluster.memory_bandwidth if on_cpu else 0.0)
    mem = cluster.host_memory_bandwidth / cluster.devices_per_node if cluster.host_memory_bandwidth else \
        (cluster.memory_bandwidth if on_cpu else 0.0)
    if link <= 0 or mem <= 0:
        raise PlanError(f"cluster {cluster.name!r} does not give host_bandwidth and host_memory_bandwidth, which "
                        "price offload; add them to its spec (bytes/s: host-device per device, host memory per node)")
    return link, mem


def offload_price(plan: Any, cluster: Any, states: Mapping[str, float], *, training: Any,
                  micro_batches: int = 1, device_step_s: float = 0.0) -> OffloadPrice:
    """The price of `plan.offload` for one device whose model states, without offload, are
    `states` ({"params", "grads", "optimizer"} bytes, as the simulator counts them);
    `device_step_s` is its optimizer step on the device, `training` the simulator's `Training`
    for the plan (its byte sizes: `simulator.training_of(plan, cluster)`)."""
    offload = getattr(plan, "offload", None)
    if not offload:
        return OffloadPrice()
    link, mem = _rates(cluster)
    owned = states.get("optimizer", 0.0) / max(1, training.master_bytes + training.optimizer_bytes)
    grads_down = owned * training.grad_bytes
    host = owned * (4 + training.optimizer_bytes + 4)  # fp32 masters, moments, fp32 gradients
    saved = states.get("optimizer", 0.0)
    host_step = owned * _HOST_STEP_BYTES / mem
    if offload == "params":
        saved += states.get("params", 0.0) + states.get("grads", 0.0)
        if training.master_bytes:  # reduced precision: the chunk in its dtype beside the fp32 master
            host += states.get("params", 0.0)
        uploads = 2 * micro_batches * states.get("params", 0.0)  # each gather, forward and backward
    else:
        uploads = owned * training.param_bytes  # the updated weights, once per step
    transfer = (grads_down + uploads) / link
    return OffloadPrice(device_bytes_saved=saved, host_bytes=host, seconds=transfer + host_step - device_step_s,
                        transfer_s=transfer, host_step_s=host_step)


def apply_offload(plan: Any, cluster: Any, training: Any, static: list[dict[str, float]], step_s: list[float],
                  micro_batches: int) -> tuple[float, list[OffloadPrice]]:
    """Move each device's offloaded states out of `static` (in place); the seconds the slowest
    device adds to the step, and each device's price. `step_s[d]` is device d's optimizer step."""
    prices = [offload_price(plan, cluster, s, training=training, micro_batches=micro_batches, device_step_s=t)
              for s, t in zip(static, step_s)]
    if not getattr(plan, "offload", None):
        return 0.0, prices
    for s in static:
        for key in ("optimizer",) + (("params", "grads") if plan.offload == "params" else ()):
            s[key] = 0.0
    return max((p.seconds for p in prices), default=0.0), prices
