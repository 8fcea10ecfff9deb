"""Random ops in the per-device programs: each piece runs under its own seed (`kernels.piece_rng`).

In a plan of more than one device every op that draws random numbers (`piece_rng.draws`) becomes
`piece_rng.seeded(_rng_token, "<op>", key, piece, *args)`: `key` is the op's rank among the graph's
random ops (the same in every plan of the graph), `piece` the sub-op's index among the op's
distinct pieces (copies share it; a co-sharded device's chunks are pieces of their own), and
`_rng_token` the forward's token, taken once at the start of every generated function that draws
(`piece_rng.forward_token(_comm)`), outside any recompute region so that a recomputed region,
which receives it as an argument, draws again what its forward drew. A one-device plan runs its
random ops as eager PyTorch does.
"""
from __future__ import annotations

import math
from typing import Optional

from nnscaler_plugins.capture.graph import Graph, Ref
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.kernels import piece_rng
from nnscaler_plugins.plan.plan import OpPlacement, Plan

TOKEN = "_rng_token"  # the generated variable holding the forward's token


def random_op_keys(graph: Graph, plan: Plan) -> dict[str, int]:
    """Op name -> key for every op of the graph that draws, in graph order (empty on one device)."""
    if plan.world_size <= 1:
        return {}
    out: dict[str, int] = {}
    for op in graph.ops:
        if piece_rng.draws(op.target, op.args, op.kwargs):
            out[op.name] = len(out)
    return out


def seed_piece(stmt, op, key: int, p: OpPlacement, index: int) -> None:
    """Make the statement of sub-op `index` of `p` (a unit view) run under its piece's seed."""
    pieces = math.prod(n for _, n in p.splits)
    piece = index % pieces if pieces else 0  # sub-ops number the copies outermost, then the splits
    if stmt.coshard is not None:
        chunks = stmt.coshard.chunks
        stmt.coshard.pieces = [(piece_rng.seeded, (Ref(TOKEN), _name(t, op), key, piece * chunks + j) + tuple(a), kw)
                               for j, (t, a, kw) in enumerate(stmt.coshard.pieces)]
    stmt.args = (Ref(TOKEN), _name(stmt.target, op), key, piece) + tuple(stmt.args)
    stmt.target = piece_rng.seeded


def _name(target, op) -> str:
    name = piece_rng.op_name(target)
    if name is None:
        raise PlanError(f"the random op's piece runs {target!r}, which generated code cannot name, so its draws "
                        "cannot be seeded per piece; run the op whole (replicate it) or in eval mode",
                        op=op.name, where=op.where())
    return name


def add_forward_tokens(stmts: dict, stmt_type: type) -> None:
    """Each (device, stage) program with a seeded statement takes the forward's token first."""
    for key, per_device in stmts.items():
        op: Optional[object] = next((s.op for s in per_device if s.target is piece_rng.seeded
                                     or (s.coshard is not None and s.coshard.pieces
                                         and s.coshard.pieces[0][0] is piece_rng.seeded)), None)
        if op is None:
            continue
        per_device.insert(0, stmt_type("op", out=[TOKEN], target=piece_rng.forward_token, args=(Ref("_comm"),),
                                       op=op, comment="this forward's seeds for its random ops"))
