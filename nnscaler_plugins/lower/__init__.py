"""Lowering: Plan + Graph -> one `Program` per device, with the communication every data
dependency needs. `placement.py` says what an op's placement means for each tensor, `layout.py`
holds RVD layouts, `resharding.py` the cheapest collectives between two layouts."""
from nnscaler_plugins.lower.lowering import Program, lower

__all__ = ["Program", "lower"]
