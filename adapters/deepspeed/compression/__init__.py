"""`deepspeed.compression`: DeepSpeed 0.19 removed its compression library and keeps this package
for the helpers scripts import from it (`deepspeed.compression.helper`); so does this drop-in. A
`compression_training` config section with a technique switched on is refused (keys.py)."""
from . import helper  # noqa: F401

__all__ = ["helper"]
