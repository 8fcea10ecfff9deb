"""Which dims of a stacked-experts module's weights may be split inside each expert (its FFN width).

Tensor parallelism inside each expert (Megatron's expert tensor parallelism) cuts every expert's
intermediate width across devices: the up (and gate) projections by output rows, the down
projection by input columns, so each device computes a partial sum of every routed token's output.
That is exact only if the module's forward is elementwise along that width between the two
projections (an activation, a gate times an up), and only if the cut follows how the module reads
fused sections (`gate_up_proj` cut by `chunk(2)` needs each device's slice of the gate *and* of the
up rows). Transformers writes several forms (a loop, grouped matmuls, weights stored transposed)
and other libraries their own, so which dim is the width, and how it is sectioned, is not read
from names. It is checked by running the module itself:

1. Candidates from the shapes: every weight dim other than the expert dim is either the model's
   hidden size or a multiple `m` of one common width `I`, read as `m` fused sections one after the
   other (cut in `m` blocks) or as one run with the sections interleaved (gpt-oss's gate and up
   rows alternate: a contiguous cut keeps pairs together). A weight with only hidden dims (a bias
   after the down projection) is read as added once: one piece gets it, the others zeros, as a
   row-parallel linear's bias. A dim equal to both (a width equal to the hidden size) yields one
   candidate for each reading.
2. Each candidate is probed: the module's own forward on small random weights of the same layout
   (hidden and width shrunk so they differ), once whole and once per piece of a 2-way cut; the
   pieces must add up to the whole output. A reading that fails to run or to add up is dropped;
   the first that passes is the answer.

No reading passing (a norm over the width, an activation mixing width positions) means the width
is not split: the rule then offers expert parallelism alone, and a plan asking for more is
refused by the strategy, by name.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nnscaler_plugins.kernels.experts_module import run_experts

_PROBE_HIDDEN, _PROBE_WIDTH, _PROBE_TOKENS = 16, 8, 5  # hidden and width differ; rows stay 16-byte aligned (grouped GEMMs)


@dataclass(frozen=True)
class IntermediateDims:
    """Per stacked weight, the dim (counting the expert dim as 0) holding the width and its number
    of fused sections (2 for a gate and an up projection stored one after the other), or None for
    a weight without the width that the forward adds once (a bias after the down projection)."""

    dims: tuple[Optional[tuple[int, int]], ...]


_CACHE: dict[tuple, Optional[IntermediateDims]] = {}

# (dim, multiple of the width, sections) per weight, or None: added once
_Reading = tuple[Optional[tuple[int, int, int]], ...]


def _readings(shapes: Sequence[tuple[int, ...]], hidden: int) -> list[_Reading]:
    """Candidate readings, most specific first: each weight has one non-hidden dim, every such dim a
    multiple of the smallest (read as that many fused sections, or as one interleaved run, which
    splits contiguously), or only hidden dims (added once, given to one piece)."""
    options: list[list[Optional[int]]] = []
    for shape in shapes:
        rest = shape[1:]
        per: list[Optional[int]] = [d + 1 for d in range(len(rest))
                                    if all(rest[j] == hidden for j in range(len(rest)) if j != d)]
        if all(r == hidden for r in rest):
            per.append(None)
        if not per:
            return []
        options.append(per)
    found: list[_Reading] = []
    for choice in itertools.product(*options):
        widths = [shapes[i][d] for i, d in enumerate(choice) if d is not None]
        if not widths:
            continue
        base = min(widths)
        if base < 1 or any(w % base for w in widths):
            continue
        multiples = [None if d is None else shapes[i][d] // base for i, d in enumerate(choice)]
        fused = tuple(None if d is None else (d, m, m) for d, m in zip(choice, multiples))
        found.append(fused)
        if any(m is not None and m > 1 for m in multiples):
            found.append(tuple(None if d is None else (d, m, 1) for d, m in zip(choice, multiples)))
    return found


def _probe_shape(shape: tuple[int, ...], experts: int, reading: Optional[tuple[int, int, int]]) -> tuple[int, ...]:
    dim = reading[0] if reading is not None else None
    return (experts,) + tuple(_PROBE_WIDTH * reading[1] if i + 1 == dim else _PROBE_HIDDEN
                              for i in range(len(shape) - 1))


def _piece(w: torch.Tensor, reading: Optional[tuple[int, int, int]], index: int, pieces: int) -> torch.Tensor:
    """Piece `index` of `pieces`: along the width dim, taken from each of its sections; a weight
    added once goes whole to piece 0 and as zeros to the others."""
    if reading is None:
        return w if index == 0 else torch.zeros_like(w)
    dim, _, sections = reading
    blocks = w.chunk(sections, dim)
    return torch.cat([b.chunk(pieces, dim)[index] for b in blocks], dim)


def _passes(key: str, names: tuple[str, ...], shapes: Sequence[tuple[int, ...]], top_k: int,
            reading: _Reading) -> bool:
    experts = top_k + 1
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(_probe_shape(s, experts, r), generator=gen, dtype=torch.float32) * 0.5
               for s, r in zip(shapes, reading)]
    x = torch.randn(_PROBE_TOKENS, _PROBE_HIDDEN, generator=gen, dtype=torch.float32)
    ids = (torch.arange(_PROBE_TOKENS).unsqueeze(1) + torch.arange(top_k).unsqueeze(0)) % experts
    w = torch.rand(_PROBE_TOKENS, top_k, generator=gen, dtype=torch.float32)
    try:
        with torch.no_grad():
            whole = run_experts(key, names, x, ids, w, tuple(weights))
            parts = [run_experts(key, names, x, ids, w, tuple(_piece(t, r, i, 2) for t, r in zip(weights, reading)))
                     for i in range(2)]
    except Exception:  # a reading whose shapes the forward cannot take is simply not this module's
        return False
    if whole.shape != x.shape or whole.abs().max() == 0:
        return False
    return torch.allclose(parts[0] + parts[1], whole, rtol=1e-4, atol=1e-5)


def intermediate_dims(key: str, names: Sequence[str], shapes: Sequence[tuple[int, ...]], hidden: int,
                      top_k: int) -> Optional[IntermediateDims]:
    """The width dims of the module registered under `key`, or None when no reading is exact."""
    cache_key = (key, tuple(names), tuple(tuple(s) for s in shapes), hidden, top_k)
    if cache_key not in _CACHE:
        found = None
        for reading in _readings([tuple(s) for s in shapes], hidden):
            if _passes(key, tuple(names), shapes, top_k, reading):
                found = IntermediateDims(tuple(None if r is None else (r[0], r[2]) for r in reading))
                break
        _CACHE[cache_key] = found
    return _CACHE[cache_key]
