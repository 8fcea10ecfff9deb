"""Finding the loss in whatever a model returns (docs/design.md, "Inputs and the loss")."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def extract_loss(output: Any, is_scalar: Optional[Callable[[Any], bool]] = None) -> Any:
    """The loss from a scalar, an object with `.loss` (Hugging Face), a dict with "loss", or a tuple:
    its first element, unless that is not a scalar and exactly one other element is (nanoGPT's
    `(logits, loss)`). `is_scalar` says which elements are scalars where they are not tensors (the
    outputs' positions, for the callers that find the loss in a captured graph). Raises TypeError
    with what was found otherwise."""
    if hasattr(output, "loss") and not isinstance(output, dict):
        return output.loss
    if isinstance(output, dict):
        if "loss" in output:
            return output["loss"]
        raise TypeError(f"model returned a dict without 'loss' (keys: {sorted(output)}); pass loss_fn=")
    if isinstance(output, (tuple, list)) and output:
        scalar = is_scalar or (lambda x: getattr(x, "ndim", None) == 0)
        if not scalar(output[0]):
            found = [x for x in output if scalar(x)]
            if len(found) == 1:
                return found[0]
        return output[0]
    if isinstance(output, (int,)) or getattr(output, "ndim", None) == 0:
        return output
    raise TypeError(f"cannot find the loss in a {type(output).__name__}; return a scalar, an object with .loss, "
                    "a dict with 'loss', or pass loss_fn=")


def loss_position(num_outputs: int, out_spec: Any, scalars: Optional[Sequence[bool]] = None) -> Optional[int]:
    """Which of a captured model's flat outputs is its loss (None when none can be told); `scalars`
    says which flat outputs are 0-dim tensors."""
    if out_spec is None:
        return 0 if num_outputs == 1 else None
    import torch.utils._pytree as pytree
    is_scalar = None if scalars is None else (lambda i: isinstance(i, int) and 0 <= i < len(scalars) and scalars[i])
    try:
        idx = extract_loss(pytree.tree_unflatten(list(range(num_outputs)), out_spec), is_scalar)
    except (TypeError, ValueError):
        return None
    return idx if isinstance(idx, int) else None
