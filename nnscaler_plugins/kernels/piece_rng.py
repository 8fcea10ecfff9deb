"""Random ops (dropout, attention dropout, `bernoulli`, `rand`, ...) on many devices: the same draws
where devices hold the same values, independent draws where they hold different ones.

Each process draws from its own generator, and nothing keeps the processes' generators in step:
ranks seeded differently, or whose earlier random ops drew different amounts (the pieces of a
split op are smaller than the whole), draw different masks for copies of one value (tensor
parallelism's replicated residual stream), which then silently differ from device to device; ranks
seeded alike draw the same mask for every piece of a split value (the heads of attention split
over devices), and data-parallel replicas the same mask for their different rows, which correlates
what one device draws independently.

So, in a plan of more than one device, every random op the lowering finds (`draws`: the aten ops
tagged `nondeterministic_seeded`, less those that draw nothing: dropout in eval or with p = 0)
runs under a seed made from:

- the base seed, rank 0's `torch.initial_seed()` when the module was built (`agree_seed`, every rank);
- the forward number: how many forwards that draw the module has run on this device
  (`forward_token`, once at the start of each generated function; the devices holding a value run
  the same forwards; a recomputed region gets the token of the forward it repeats, since the token
  is an argument of the region);
- the op (its rank among the graph's random ops) and its piece (the sub-op's index among the op's
  distinct pieces; copies of a piece share it);
- the data-parallel replica (replicas hold different rows).

The device's generator is set to that seed for the op and given back its state afterwards, so the
draws of code outside the model are untouched. Copies of a value draw the same numbers; pieces and
replicas draw from unrelated seeds; the rate is the op's own, drawn by torch's own kernel. A piece
that is the whole op on one replica (a pipeline stage's dropout, a dropout on tensor parallelism's
replicated values) draws what `fork(Token(seed, forward, 0), key, 0, device)` around the eager op
draws: a one-process reference can reproduce the parallel run's masks exactly.

Why not one mask for the whole value, sliced (which would reproduce one process for every plan):
each device would draw the whole global tensor's numbers for every random op, data parallelism
times tensor parallelism times the work, where the scheme here draws only its piece's.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

#: Dropout-style ops: (index of p, index of train) in their arguments.
_DROPOUTS = {"aten.dropout.default": (1, 2), "aten.native_dropout.default": (1, 2),
             "aten.feature_dropout.default": (1, 2), "aten.alpha_dropout.default": (1, 2),
             "aten.feature_alpha_dropout.default": (1, 2)}
_ATTENTION = {"aten.scaled_dot_product_attention.default": 4}  # index of dropout_p



class _Stream:
    """One parallel module's random stream: its base seed and the forwards that drew so far."""

    def __init__(self, seed: int):
        self.seed = seed
        self.forwards = 0


#: Per parallel module (keyed by its process groups, which every Comm of the module shares).
_STREAMS: "weakref.WeakKeyDictionary[Any, _Stream]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Token:
    """What the seeds of one forward's random ops are made from (besides the op and its piece)."""

    seed: int
    forward: int
    replica: int = 0


def draws(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of `target` with these arguments draws random numbers."""
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    name = str(target)
    if name in _DROPOUTS:
        at_p, at_train = _DROPOUTS[name]
        p = args[at_p] if len(args) > at_p else kwargs.get("p", 0.5)
        train = args[at_train] if len(args) > at_train else kwargs.get("train", True)
        return bool(train) and not (isinstance(p, (int, float)) and p == 0)
    if name in _ATTENTION:
        at = _ATTENTION[name]
        p = args[at] if len(args) > at else kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def agree_seed(comm: Any, device: Optional[torch.device] = None) -> int:
    """Start the random stream of the module `comm` serves: every rank takes rank 0's
    `torch.initial_seed()` as its base seed (a broadcast over the default group when one is
    initialized; every rank calls it), and its forwards are counted from 0. Returns the seed."""
    seed = torch.initial_seed() & ((1 << 63) - 1)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([seed], dtype=torch.int64, device=device if device is not None else "cpu")
        dist.broadcast(t, src=0)
        seed = int(t.item())
    _STREAMS[comm.groups] = _Stream(seed)
    return seed


def stream_state(comm: Any) -> Optional[tuple[int, int]]:
    """(base seed, forwards drawn so far) of the module `comm` serves, or None before it has one:
    what a checkpoint keeps so a resumed job draws the masks the uninterrupted one would."""
    stream = _STREAMS.get(comm.groups)
    return None if stream is None else (stream.seed, stream.forwards)


def set_stream_state(comm: Any, state: tuple[int, int]) -> None:
    """Continue the module's random stream from a `stream_state` saved earlier."""
    stream = _Stream(int(state[0]))
    stream.forwards = int(state[1])
    _STREAMS[comm.groups] = stream


def forward_token(comm: Any) -> Token:
    """The token of this forward (called once at the start of each generated function that draws):
    the module's base seed, its forward number, and the data-parallel replica `comm` runs in."""
    stream = _STREAMS.get(comm.groups)
    if stream is None:  # generated code run without its module (the module agrees on the seed)
        stream = _STREAMS[comm.groups] = _Stream(torch.initial_seed() & ((1 << 63) - 1))
    n = stream.forwards
    stream.forwards = n + 1
    replica = comm.groups.global_rank(0) // comm.program.plan.unit_size
    return Token(stream.seed, n, replica)


def piece_seed(token: Token, key: int, piece: int) -> int:
    """The seed of piece `piece` of random op `key` in the forward `token` names."""
    data = struct.pack("<qqqqq", token.seed, token.forward, token.replica, key, piece)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if device.type == "cpu" or device.type == "meta":
        return torch.default_generator
    module = getattr(torch, device.type, None)  # xpu, mps, ...: their default generator
    gens = getattr(module, "default_generators", None)
    if gens:
        return gens[device.index or 0]
    raise RuntimeError(f"no default generator known for device type {device.type!r}")


@contextlib.contextmanager
def fork(token: Token, key: int, piece: int, device: torch.device) -> Iterator[None]:
    """The device's default generator seeded for this piece inside, its state given back after."""
    gen = _generator(device)
    state = gen.get_state()
    gen.manual_seed(piece_seed(token, key, piece))
    try:
        yield
    finally:
        gen.set_state(state)


@functools.lru_cache(maxsize=None)
def _resolve(name: str) -> Any:
    """An op from its name: "aten.dropout.default" or "module:qualname"."""
    if ":" in name:
        module, _, qual = name.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device
    d = kwargs.get("device")
    return torch.device(d) if d is not None else torch.device("cpu")


def seeded(token: Token, op: str, key: int, piece: int, *args: Any, **kwargs: Any) -> Any:
    """Run op `op` (by name) on these arguments with the generator seeded for (token, key, piece)."""
    with fork(token, key, piece, _device_of(args, kwargs)):
        return _resolve(op)(*args, **kwargs)


def op_name(target: Any) -> Optional[str]:
    """The name `seeded` resolves `target` by (None for a callable it cannot import by name)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    mod, qual = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if mod and qual and "<" not in qual:
        return f"{mod}:{qual}"
    return None
