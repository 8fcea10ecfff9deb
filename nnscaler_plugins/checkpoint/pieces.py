"""Where each tensor of a module's training state lives on this rank, as pieces of whole tensors.

Saving writes, for every state tensor, only the pieces this rank is the first holder of: the
replica-0 copy of its layout's piece, and under ZeRO every data-parallel replica's own chunk (of
a ZeRO-3 parameter, or of a sharded optimizer's state); tied names are stored once. Loading fills
exactly the piece (or chunk) this rank holds under its current plan. The same rules cover model
tensors, the state of an optimizer `nns.build_optimizer` made, and a plain torch optimizer's
state shaped like its parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.model_state import is_parallel
from nnscaler_plugins.checkpoint.regions import Region


@dataclass
class Piece:
    """Flat elements [lo, hi) of `region` of the whole tensor `name` (shape `shape`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    region: Region
    lo: int
    hi: int


@dataclass
class Slot:
    """One state tensor this rank holds: where it sits in the whole tensor, and whether this rank
    is the one that writes those elements."""

    name: str  # the model's name (the first of tied names)
    key: Optional[str]  # the shard key in the program (None for a plain module)
    piece: Piece
    writes: bool
    zeroed: bool = False  # a value chunk other than the first of a partial layout (held as zeros)


def _parallel(module: Any) -> bool:
    return is_parallel(module) and getattr(module, "program", None) is not None


def first_keys(module: Any) -> dict[str, str]:
    """Model name -> the first shard key of it in program order (the copy whose holders write)."""
    out: dict[str, str] = {}
    for v, s in module.program.shards.items():
        if s.in_state_dict:
            out.setdefault(s.fqn, v)
    return out


def aliases(module: Any) -> dict[str, str]:
    """Tied names -> the name stored for them."""
    if not _parallel(module):
        first: dict[int, str] = {}
        out = {}
        for n, t in module.state_dict(keep_vars=True).items():
            if id(t) in first:
                out[n] = first[id(t)]
            else:
                first[id(t)] = n
        return out
    out = {}
    for v, s in module.program.shards.items():
        if s.in_state_dict:
            for a in s.aliases:
                if a != s.fqn:
                    out.setdefault(a, s.fqn)
    return out


def writer_table(module: Any) -> dict[str, dict[tuple[int, ...], tuple[int, Optional[int]]]]:
    """Model name -> piece (split digits) -> (replica digit, data-parallel rank; None when every
    replica writes its ZeRO-3 chunk) of the holder that writes it. Copies are spread so that every
    rank writes about as many bytes (largest pieces first, onto the rank with the fewest so far);
    every rank computes the same table from the program alone."""
    plan, program = module.plan, module.program
    loads = [0] * plan.world_size
    jobs = []
    for fqn, v in first_keys(module).items():
        s = program.shards[v]
        lay = s.layout
        if lay.partial > 1:
            continue
        chunked = plan.zero >= 3 and plan.dp > 1 and s.kind == "param" and module.graph.meta(s.value).requires_grad
        nbytes = math.prod(lay.local_shape()) * module.graph.meta(s.value).dtype.itemsize
        for pos, device in enumerate(lay.group):
            r, _, d = lay.digits(pos)
            if r == 0:
                holders = [lay.group[lay.position(rr, 0, d)] for rr in range(lay.replicas)]
                jobs.append((nbytes, fqn, d, holders, chunked))
    out: dict[str, dict[tuple[int, ...], tuple[int, Optional[int]]]] = {}
    for nbytes, fqn, d, holders, chunked in sorted(jobs, key=lambda j: (-j[0], j[1], j[2])):
        best = None
        for rr, device in enumerate(holders):
            for k in ([None] if chunked else range(plan.dp)):
                ranks = [kk * plan.unit_size + device for kk in range(plan.dp)] if k is None \
                    else [k * plan.unit_size + device]
                load = max(loads[g] for g in ranks)
                if best is None or load < best[0]:
                    best = (load, rr, k, ranks)
        _, rr, k, ranks = best
        share = nbytes // (len(ranks))
        for g in ranks:
            loads[g] += share
        out.setdefault(fqn, {})[d] = (rr, k)
    return out


def _writes(table: dict, fqn: str, lay: Any, device: int, dp_rank: int, every_replica: bool) -> bool:
    r, _, d = lay.digits(lay.position_of(device))
    if fqn not in table:
        return False
    rr, k = table[fqn][d]
    return r == rr and (every_replica or k is None or k == dp_rank)


def _chunk(module: Any, fqn: str) -> Optional[tuple[int, int]]:
    """The ZeRO-3 chunk [lo, hi) of the piece this replica's parameter holds, None when whole."""
    if getattr(module, "zero3", None) is None:
        return None
    fs = module.zero_shards.get(fqn)
    return None if fs is None or fs.size == 1 else (fs.lo, fs.hi)


def model_slots(module: Any, rank: int = 0) -> Iterator[Slot]:
    """Every model state tensor this rank holds (each held shard key once), in program order."""
    if not _parallel(module):
        tied = aliases(module)
        for n, t in module.state_dict().items():
            if n not in tied:
                shape = tuple(t.shape)
                yield Slot(n, None, Piece(n, shape, t.dtype, Region.whole(shape), 0, t.numel()), rank == 0)
        return
    program, device = module.program, module.unit_device
    firsts, table = first_keys(module), writer_table(module)
    for v in module.held_keys:
        s = program.shards[v]
        if not s.in_state_dict:
            continue
        lay = s.layout
        r, part, _ = lay.digits(lay.position_of(device))
        region = Region.of_layout(lay, device)
        chunk = _chunk(module, s.fqn) if s.kind == "param" else None
        lo, hi = chunk if chunk is not None else (0, region.numel)
        writes = firsts[s.fqn] == v and _writes(table, s.fqn, lay, device, module.dp_rank, chunk is not None)
        dtype = module.graph.meta(s.value).dtype
        yield Slot(s.fqn, v, Piece(s.fqn, tuple(lay.shape), dtype, region, lo, hi), writes, zeroed=part != 0)


def partial_keys(module: Any) -> list[str]:
    """Shard keys of state tensors held as partial sums (written whole after summing them)."""
    if not _parallel(module):
        return []
    firsts = first_keys(module)
    return [v for v in firsts.values() if module.program.shards[v].layout.partial > 1]


def model_data(module: Any, slot: Slot) -> torch.Tensor:
    """The flat elements of the slot's piece this rank holds, in the state's dtype."""
    if slot.key is None:
        return module.state_dict()[slot.name].detach().reshape(-1)
    t = module.local_tensor(slot.key).detach()
    return t.reshape(-1).to(slot.piece.dtype)


# -- optimizer state -------------------------------------------------------------------------------
@dataclass
class OptimizerSlot:
    """One parameter's optimizer state on this rank: where its tensors sit in the whole parameter,
    whether this rank writes them, and its state {key: tensor shaped like the piece, or value}."""

    fqn: str
    region: Region
    shape: tuple[int, ...]
    lo: int
    hi: int
    writes: bool
    state: dict[str, Any]


def knows_plan_pieces(optimizer: Any) -> bool:
    return hasattr(optimizer, "local_state") and hasattr(optimizer, "load_local_state")


def optimizer_slots(module: Any, optimizer: Any, rank: int = 0) -> list[OptimizerSlot]:
    """This rank's optimizer state per parameter it holds."""
    if not _parallel(module):
        names = {id(p): n for n, p in module.named_parameters()}
        out = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                shape = tuple(p.shape)
                out.append(OptimizerSlot(names[id(p)], Region.whole(shape), shape, 0, p.numel(), rank == 0,
                                         dict(optimizer.state.get(p, {}))))
        return out
    by_key = _held_params(module)
    firsts, table = first_keys(module), writer_table(module)
    out = []
    if knows_plan_pieces(optimizer):
        local = optimizer.local_state()
        items = [(fqn, chunk, st) for fqn, (chunk, st) in local.items()]
    else:
        index = {id(module.local_tensor(v)): (module.program.shards[v].fqn) for v in by_key.values()}
        items = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                fqn = index.get(id(p))
                if fqn is None:
                    raise CheckpointError("the optimizer holds a tensor that is not a parameter of this module; "
                                          "build it over module.parameters() of the module being saved")
                items.append((fqn, _chunk(module, fqn), dict(optimizer.state.get(p, {}))))
    for fqn, chunk, st in items:
        v = by_key[fqn]
        lay = module.program.shards[v].layout
        region = Region.of_layout(lay, module.unit_device)
        lo, hi = chunk if chunk is not None else (0, region.numel)
        if lay.partial > 1:
            raise CheckpointError(f"parameter {fqn} is held as partial sums ({lay}); its optimizer state has no "
                                  "piece to save")
        writes = firsts[fqn] == v and _writes(table, fqn, lay, module.unit_device, module.dp_rank, chunk is not None)
        out.append(OptimizerSlot(fqn, region, tuple(lay.shape), lo, hi, writes, st))
    return out


def _held_params(module: Any) -> dict[str, str]:
    """Parameter name -> the first shard key of it this device holds."""
    out: dict[str, str] = {}
    for v in module.held_keys:
        s = module.program.shards[v]
        if s.kind == "param":
            out.setdefault(s.fqn, v)
    return out


def is_piece_tensor(value: Any, slot: OptimizerSlot) -> bool:
    """Whether an optimizer state value is elementwise with the parameter (Adam's moments, masters)."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == slot.hi - slot.lo \
        and (value.dim() == 1 or tuple(value.shape) == slot.region.shape)

