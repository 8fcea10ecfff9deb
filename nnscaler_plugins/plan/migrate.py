"""Reading plan files of earlier formats: version 1 knew its degrees only as a unit size, a
replica count and a pipeline, with the strategy's options beside them. Its mesh is read back from
those once, here, when such a file is loaded; plans made now carry their mesh from the start.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from nnscaler_plugins.plan.mesh import Mesh

_DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3")


def migrated_mesh(unit: int, dp: int, pipeline: Optional[Any], options: Mapping[str, Any],
                  strategy: str = "") -> Mesh:
    """The mesh a version-1 plan ran with, from its unit, replicas, pipeline and recorded options."""
    pp = pipeline.num_ranks if pipeline is not None else 1
    group = max(1, unit // max(1, pp))
    if unit == 1 or strategy in _DATA_PARALLEL:
        return Mesh(("dp",), (dp * unit,), 1) if unit == 1 else Mesh(("dp", "unit"), (dp, unit), 1)
    if strategy == "ep" or ("ep" in options and "cp" not in options):
        etp = int(options.get("etp", 1) or 1)
        tp = int(options.get("tp", 1) or 1)
        return Mesh(("dp", "pp", "ep", "etp"), (dp, pp, group // etp, etp), 1, (("tp", tp),) if tp > 1 else ())
    cp = int(options.get("cp", 1) or 1)
    if strategy == "cp" or cp > 1:
        tp = int(options.get("tp", 1) or 1) if strategy == "cp" else max(1, group // cp)
        return Mesh(("dp", "pp", "tp", "cp"), (dp, pp, tp, group // tp), 1)
    return Mesh(("dp", "pp", "tp"), (dp, pp, group), 1)
