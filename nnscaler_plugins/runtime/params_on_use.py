"""What a stage function of the generated code unpacks as `_P`: this device's parameters and
buffers of that stage, in Program order, as the code takes them (`precision.for_compute`).

Without ZeRO-3 that is a plain list, or, while ZeRO-1/2's gathers of the updated weights are still
in flight (`zero.PendingGather`), `SettledOnUse`, which waits for a parameter's gather when the code
first reads it. Under ZeRO-3 it is `GatheredOnUse`: the generated code binds each parameter `_P[i]`
at its first use and deletes it after its last, so each one is gathered whole at that moment
(`Zero3Params.fetch`), with the next one's gather started, not all up front. Parameters of one
layer travel together (`gather_units`): the first one read starts one collective for the layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from nnscaler_plugins.runtime.precision import for_compute
from nnscaler_plugins.runtime.zero import PendingGather, Zero3Params

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.lower.lowering import Program


def params_on_use(program: Program, keys: list[str], local: Callable[[str], torch.Tensor], precision: str,
                  zero3: Optional[Zero3Params] = None, zero3_index: Optional[dict[str, int]] = None,
                  pending: Optional[PendingGather] = None) -> Any:
    """`_P` for the shards `keys` (`local(key)` is this device's tensor of one); under ZeRO-3,
    `zero3_index` gives each chunked parameter's key in `zero3` by fqn; `pending`: gathers of
    updated weights that may still be in flight."""
    if zero3 is None:
        if pending is not None and pending.pending:
            return SettledOnUse(keys, local, precision, pending)
        return [for_compute(local(key), precision) for key in keys]
    return GatheredOnUse(program, keys, local, precision, zero3, zero3_index or {})


def zero3_items(program: Program, keys: list[str], zero3_index: dict[str, int]) -> dict[int, int]:
    """Item i of `_P` (the shards `keys`) -> its ZeRO-3 key, for the items that are chunked parameters."""
    out = {}
    for i, key in enumerate(keys):
        s = program.shards[key]
        if s.kind == "param" and s.fqn in zero3_index:
            out[i] = zero3_index[s.fqn]
    return out


def first_gathered(program: Program, keys: list[str], zero3_index: dict[str, int]) -> Optional[int]:
    """The ZeRO-3 key of the parameter a stage reading `keys` as `_P` reads first (Program order, as
    `GatheredOnUse` prefetches), or None when it reads none."""
    items = zero3_items(program, keys, zero3_index)
    return items[min(items)] if items else None


#: The most bytes of whole parameters one gather unit holds (a layer larger than this is cut).
UNIT_BYTES = 25 * 2**20


def layer_prefix(fqn: str) -> str:
    """The repeated layer a parameter belongs to ("model.layers.3" of "model.layers.3.mlp.up.weight"),
    "" for one outside every numbered layer (embeddings, final norm, head)."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def gather_units(fqns: list[str], nbytes: list[int], limit: int = UNIT_BYTES) -> list[list[int]]:
    """Indices of parameters gathered together: runs of consecutive ones (in the order the code
    reads them) of one layer, each at most `limit` bytes and at most a quarter of all of them (a
    parameter larger than that alone), so that the unit in use and the next one, gathered beside
    it, stay about half of the whole parameters at most, however few layers a stage holds."""
    limit = min(limit, sum(nbytes) // 4)
    units: list[list[int]] = []
    last, size = None, 0
    for i, (fqn, n) in enumerate(zip(fqns, nbytes)):
        prefix = layer_prefix(fqn)
        if units and prefix == last and size + n <= limit:
            units[-1].append(i)
            size += n
        else:
            units.append([i])
            last, size = prefix, n
    return units


class GatheredOnUse:
    """The generated code's `_P` under ZeRO-3: item i is this device's parameter or buffer i, a
    ZeRO-3 parameter gathered whole at the moment it is read, with the next one's gather started."""

    def __init__(self, program: Program, keys: list[str], local: Callable[[str], torch.Tensor], precision: str,
                 zero3: Zero3Params, zero3_index: dict[str, int]):
        self._keys = keys
        self._local = local
        self._precision = precision
        self._zero3 = zero3
        zero3.new_forward()  # a new forward: float8 weights are scaled from the weights as they are now
        self._zkey = zero3_items(program, keys, zero3_index)
        order = sorted(self._zkey)
        self._next = {i: self._zkey[j] for i, j in zip(order, order[1:])}
        fqns = [program.shards[keys[i]].fqn for i in order]
        nbytes = [zero3.shards[self._zkey[i]].numel * zero3.chunks[self._zkey[i]].element_size() for i in order]
        zero3.gather_together([[self._zkey[order[j]] for j in unit] for unit in gather_units(fqns, nbytes)])
        self._read: set[int] = set()

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        z = self._zkey.get(i)
        # A parameter read again (the code dropped it between distant uses) prefetches nothing: the
        # one after it in Program order was read already.
        nxt = self._next.get(i) if i not in self._read else None
        self._read.add(i)
        t = self._local(self._keys[i]) if z is None else self._zero3.fetch(z, nxt)
        return for_compute(t, self._precision)


class SettledOnUse:
    """The generated code's `_P` while ZeRO-1/2 gathers of updated weights are in flight: item i is
    this device's parameter or buffer i, its gather waited for when the code first reads it."""

    def __init__(self, keys: list[str], local: Callable[[str], torch.Tensor], precision: str, pending: PendingGather):
        self._keys = keys
        self._local = local
        self._precision = precision
        self._pending = pending

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i: int) -> torch.Tensor:
        t = self._local(self._keys[i])
        self._pending.wait_for(t)
        return for_compute(t, self._precision)
