"""Megatron-style tensor parallelism found by layout propagation (`passes.apply_tp`), inside units
of the mesh's "tp" devices, replicated over its "dp" axis (`hybrid` is the same with both degrees
named); and co-shard, its variant that runs each device's piece in chunks.

No module names and no model classes: column/row pairs, head-parallel attention, vocabulary-
parallel embeddings and cross-entropy all fall out of the ops' dimension rules, so models the
strategy was never shown get the same treatment as GPT-2 and Llama.
"""
from __future__ import annotations

from typing import Any, Optional

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.passes import Parallelization, apply_batch_statistics, apply_recompute, apply_tp
from nnscaler_plugins.plan.mesh import MeshLayout
from nnscaler_plugins.plan.primitives import PlanBuilder

#: The whole world one tensor-parallel unit unless tp= or dp= says otherwise.
MESH = MeshLayout(("dp", "tp"), fill=("tp", "dp"))
#: Both degrees or one of them (the other follows).
HYBRID_MESH = MeshLayout(("dp", "tp"), fill=("tp", "dp"), require_one_of=("tp", "dp"))


def tensor_parallel(builder: PlanBuilder, *, recompute: Any = None, batch_statistics: Optional[str] = None,
                    **options: Any) -> None:
    """Split the model across the unit's devices; every op gets a split or runs whole. A split of
    the batch inside the unit leaves partial sums the lowering adds up exactly; the `dp` copies of
    the unit (hybrid) get the loss's nonlinear batch statistics made whole across them."""
    par = Parallelization(builder, MESH, options)
    apply_tp(par)
    par.place()
    apply_recompute(builder, recompute)
    apply_batch_statistics(builder, batch_statistics)


def coshard(builder: PlanBuilder, *, chunks: int = 2, modules: Optional[tuple[str, ...]] = None,
            recompute: Any = None, batch_statistics: Optional[str] = None, **options: Any) -> None:
    """Tensor parallelism where every split op runs as `chunks` pieces per device, one after
    another, each recomputed in backward (co-shard): the same communication as `tp` with a
    fraction of its activation memory inside attention and MLP blocks.

    `modules` limits co-sharding to ops whose module path contains one of the given names (all
    split ops by default). Ops whose pieces must talk to each other (a vocabulary-parallel loss) or
    whose dim does not divide into devices x chunks stay plainly split.
    """
    chunks = int(chunks)
    if chunks < 1:
        raise PlanError(f"coshard: chunks must be >= 1 (got {chunks})")
    par = Parallelization(builder, MESH, options)
    choices = apply_tp(par)
    n = par.degree("tp")
    for op in builder.ops:
        c = choices.get(op.name)
        if c is None or c.label is None:
            continue
        wanted = modules is None or any(m in op.node.module_path for m in modules)
        if wanted and c.label not in op.signature.comm_labels and op.splittable(c.label, n * chunks, c.block):
            par.split(op, "tp", c.label, c.block, chunks)
    par.place()
    apply_recompute(builder, recompute)  # co-sharded ops are recomputed already
    apply_batch_statistics(builder, batch_statistics)
