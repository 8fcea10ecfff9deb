"""What the compile stage hands each rank: everything the runtime needs to run a plan, and nothing
that would make the runtime compile anything itself.

An `Artifact` holds the rank's generated module (already written to the code cache and imported),
the lowered `Program` whose tables the module's collectives index (the shard specs: which piece of
each parameter this device stores; the group specs: which device sets communicate), the callback
that serves batches of other sizes (`shapes`, see `shapes.py`) and the counter of a batch's loss
items (`loss_items`, see `loss_items.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # pragma: no cover
    from nnscaler_plugins.compiler.loss_items import LossItems
    from nnscaler_plugins.compiler.regions import RegionLog
    from nnscaler_plugins.compiler.shapes import ShapePrograms
    from nnscaler_plugins.lower.lowering import ParamShard, Program


@dataclass
class Artifact:
    """One device of the plan's unit, compiled (every data-parallel replica's device `unit_device`
    runs the same artifact)."""

    program: "Program"
    unit_device: int
    module: Any  # the generated Python module: `forward`/`forward_loss`, or `stage{k}`/`stage{k}_loss`
    source_path: str  # where the module's source was written (the code cache)
    shapes: "ShapePrograms"  # the callback for inputs of other sizes than the example's
    loss_items: "LossItems"  # counts the items a batch's loss averages over (targets not ignored, or samples)
    compile_seconds: float = 0.0  # lowering, code generation and loading of this artifact
    notes: list[str] = field(default_factory=list)  # what the compile stage wants said once (warnings)
    # torch.compile's backend its regions run under (None: eager), and their first calls' seconds
    compile_backend: Optional[str] = None
    region_log: Optional["RegionLog"] = None
    # The same device's artifact with its regions under torch.compile (backend; None: the plan's)
    with_compile: Optional[Callable[[Optional[str]], "Artifact"]] = field(default=None, repr=False)

    @property
    def torch_compile_seconds(self) -> float:
        """Seconds the first calls of its compiled regions took so far (torch.compile's work)."""
        return self.region_log.seconds if self.region_log is not None else 0.0

    @property
    def plan(self) -> Any:
        return self.program.plan

    @property
    def graph(self) -> Any:
        return self.program.graph

    @property
    def shard_specs(self) -> dict[str, "ParamShard"]:
        """Per stored tensor key: its model name, kind and layout on the unit (`Program.shards`)."""
        return self.program.shards

    @property
    def group_specs(self) -> list[tuple[int, ...]]:
        """The unit-relative device sets any collective of this plan runs over, in creation order."""
        return self.program.groups_needed()

    def source(self) -> str:
        """The generated code this device runs (the file a reader opens)."""
        with open(self.source_path) as f:
            return f.read()

    def held_keys(self) -> list[str]:
        """Keys of the tensors this device stores, in program order."""
        return list(self.program.ranks[self.unit_device].params)

    def describe(self) -> Optional[str]:
        return (f"device {self.unit_device} of {self.program.unit_size} ({self.plan.strategy}): "
                f"{len(self.held_keys())} tensors held, {len(self.group_specs)} process groups, {self.source_path}")
