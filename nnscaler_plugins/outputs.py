"""Finding the loss in whatever a model returns (docs/design.md, "Inputs and the loss")."""
from __future__ import annotations

from typing import Any, Optional


def extract_loss(output: Any) -> Any:
    """The loss from a scalar, an object with `.loss` (Hugging Face), a dict with "loss", or a tuple
    whose first element is the loss. Raises TypeError with what was found otherwise."""
    if hasattr(output, "loss") and not isinstance(output, dict):
        return output.loss
    if isinstance(output, dict):
        if "loss" in output:
            return output["loss"]
        raise TypeError(f"model returned a dict without 'loss' (keys: {sorted(output)}); pass loss_fn=")
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    if isinstance(output, (int,)) or getattr(output, "ndim", None) == 0:
        return output
    raise TypeError(f"cannot find the loss in a {type(output).__name__}; return a scalar, an object with .loss, "
                    "a dict with 'loss', or pass loss_fn=")


def loss_position(num_outputs: int, out_spec: Any) -> Optional[int]:
    """Which of a captured model's flat outputs is its loss (None when none can be told)."""
    if out_spec is None:
        return 0 if num_outputs == 1 else None
    import torch.utils._pytree as pytree
    try:
        idx = extract_loss(pytree.tree_unflatten(list(range(num_outputs)), out_spec))
    except (TypeError, ValueError):
        return None
    return idx if isinstance(idx, int) else None
