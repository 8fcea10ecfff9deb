"""The search's progress bar is the package's one progress implementation (`nnscaler_plugins.progress`);
this name stays importable for the solver and for code written against it."""
from nnscaler_plugins.progress import Progress

__all__ = ["Progress"]
