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
    raise TypeError(non_scalar_loss(output) or f"forward returned {_describe(output)}, not a 0-dim loss (a scalar, "
                    "an object with .loss or a dict with 'loss'); return the loss, or pass loss_fn=")


def _describe(x: Any) -> str:
    """A value in words for an error message: a tensor (or a graph's TensorMeta) by its shape."""
    shape = getattr(x, "shape", None)
    if shape is not None and not callable(shape):
        return f"a tensor of shape {list(shape)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (tuple, list)):
        inner = f" (first element {_describe(x[0])})" if x else ""
        return f"a {type(x).__name__} of {len(x)}{inner}"
    return f"a {type(x).__name__}"


def _numel(x: Any) -> Optional[int]:
    n = getattr(x, "numel", None)
    if n is None:
        return None
    return n() if callable(n) else n


def non_scalar_loss(loss: Any, output: Any = None, source: str = "forward") -> Optional[str]:
    """Why `loss` (found in `output`, what `source` returned) cannot be back-propagated as a loss,
    or None when it can: a one-element floating-point tensor, as `loss.backward()` needs. A
    forward that returns logits would otherwise fail deep in autograd ("grad can be implicitly
    created only for scalar outputs"). `loss` and `output` may hold a graph's TensorMeta in place
    of tensors (the check before a step runs)."""
    n = _numel(loss)
    dtype = getattr(loss, "dtype", None)
    if n == 1 and dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        return None
    if isinstance(output, (tuple, list)) and output:
        what = f"a {type(output).__name__} of {len(output)} with no scalar in it (its first element: {_describe(loss)})"
    elif output is not None and output is not loss:
        what = f"{_describe(output)} whose loss is {_describe(loss)}"
    else:
        what = _describe(loss)
    if n == 1:
        what += f" of dtype {str(dtype).replace('torch.', '')}"
    fix = "return a scalar loss from it" if source == "loss_fn" else "return the loss, or pass loss_fn="
    return f"{source} returned {what}, not a scalar loss; {fix}"


def require_scalar_loss(loss: Any, output: Any = None, source: str = "forward") -> Any:
    """`loss` when it can be back-propagated (`non_scalar_loss`); TypeError naming what was found
    otherwise."""
    problem = non_scalar_loss(loss, output, source)
    if problem is not None:
        raise TypeError(problem)
    return loss


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
