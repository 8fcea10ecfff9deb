"""Code generation: a Program's rank -> one readable Python file, cached by everything it depends on."""
from nnscaler_plugins.codegen.generate import generate, write_and_load

__all__ = ["generate", "write_and_load"]
