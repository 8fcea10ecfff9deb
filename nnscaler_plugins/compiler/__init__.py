"""The compile stage: lowering and code generation, owned by the API (`nns.compile`).

`compile_program(graph, plan, model=...)` returns a `Compiled`, whose `artifact(device)` is what one
device runs: its generated module, its shard and group specs, and the callback that serves inputs
of other sizes. The runtime runs artifacts and never calls capture, lowering or code generation.
"""
from nnscaler_plugins.compiler.artifact import Artifact
from nnscaler_plugins.compiler.compile import DEFAULT_CACHE_DIR, Compiled, compile_program
from nnscaler_plugins.compiler.shapes import ShapeProgram, ShapePrograms

__all__ = ["Artifact", "Compiled", "compile_program", "ShapeProgram", "ShapePrograms", "DEFAULT_CACHE_DIR"]
