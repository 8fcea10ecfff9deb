"""Capture: a PyTorch model and example inputs -> `Graph` (torch.export, non-strict, training IR).

`tracing.py` runs the export and converts it; `graph.py` is the plain-data graph every later stage
reads; `repeated_layers.py` traces a stack of identical layers two deep; `causal_mask.py` gives a
traced causal mask back to attention; `autograd_functions.py` keeps custom Functions whole;
`experts.py` (with `experts_probe.py`) keeps mixture-of-experts modules whole, their data-dependent
split sizes inside one op; `microbatch.py` cuts a batch the way capture and `train_step` agree on.
"""
from nnscaler_plugins.capture.tracing import CaptureError, capture, normalize_inputs

__all__ = ["CaptureError", "capture", "normalize_inputs"]
