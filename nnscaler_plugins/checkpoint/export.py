"""`export`: the model as one ordinary state dict file, or as a Hugging Face `save_pretrained`
directory, for use without nnscaler (inference, hubs, other trainers).

Streamed tensor by tensor: the ranks make one whole tensor at a time (each rank holds at most
that one beyond its own pieces) and rank 0 appends it to the output before the next is made, so no
process ever holds the whole state. A `save_pretrained` directory gets a `model.safetensors`
written directly (header first, from the shapes the plan knows, then each tensor's bytes); a
single file is a torch.save state dict whose tensors are read, while torch.save writes them,
from a memory-mapped spill file rather than from memory.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Any, Iterator, Optional

import numpy as np
import torch

from nnscaler_plugins.checkpoint.agreement import (
    begin_round,
    exchange,
    finish_round,
    world,
)
from nnscaler_plugins.checkpoint.atomic import (
    fsync_dir,
    fsync_file,
    sibling,
    swap_into_place,
)
from nnscaler_plugins.checkpoint.errors import CheckpointError
from nnscaler_plugins.checkpoint.model_state import is_parallel

WHAT = "nns.checkpoint.export"
_SAFE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


def write_state_dict_file(state: dict[str, torch.Tensor], path: str) -> None:
    """torch.save to a temporary sibling, synced, then renamed over `path` (never half a file)."""
    tmp = sibling(path, "saving", secrets.token_hex(6))
    try:
        torch.save(state, tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path))


def state_layout(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every state name with its whole shape and dtype, in the order `whole_tensors` yields them
    (tied names right after the name they share with); no communication."""
    if not (is_parallel(module) and getattr(module, "program", None) is not None):
        return [(n, tuple(t.shape), t.dtype) for n, t in module.state_dict().items()]
    out, seen = [], set()
    for v, s in module.program.shards.items():
        if not s.in_state_dict or s.fqn in seen:
            continue
        seen.add(s.fqn)
        dtype = module.graph.meta(s.value).dtype
        for name in (s.fqn, *[a for a in s.aliases if a != s.fqn]):
            out.append((name, tuple(s.layout.shape), dtype))
    return out


def whole_tensors(module: torch.nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, whole tensor) one at a time, in `state_layout` order (collective over the ranks of
    a ParallelModule: every rank iterates to the end)."""
    if not (is_parallel(module) and getattr(module, "program", None) is not None):
        groups: dict[int, list[str]] = {}
        state = module.state_dict()
        for n, t in state.items():
            groups.setdefault(id(t), []).append(n)
        for names in groups.values():
            yield names, state[names[0]].detach().cpu()
        return
    zero3 = getattr(module, "zero3", None)
    zero3_index = {fqn: i for i, fqn in enumerate(module.zero_shards)} if zero3 is not None else {}
    seen = set()
    for v, s in module.program.shards.items():
        if not s.in_state_dict or s.fqn in seen:
            continue
        seen.add(s.fqn)
        dtype = module.graph.meta(s.value).dtype
        local = module.local_tensor(v).detach() if v in module.held_keys else None
        if local is not None and s.fqn in zero3_index:
            with torch.no_grad():
                local = zero3.gather([zero3_index[s.fqn]])[zero3_index[s.fqn]]
        whole = module.whole_tensor(v, None if local is None else local.detach().to(dtype), dtype)
        yield [s.fqn, *[a for a in s.aliases if a != s.fqn]], whole.detach().cpu()
        del whole, local


def _check_hf(hf_model: Any, names: set[str]) -> None:
    if not hasattr(hf_model, "save_pretrained") or not hasattr(hf_model, "config"):
        raise CheckpointError(f"{WHAT}: hf_model must be a Hugging Face PreTrainedModel (the model you parallelized, "
                              f"for its config and class); got {type(hf_model).__name__}")
    theirs = set(hf_model.state_dict())
    missing, unexpected = sorted(theirs - names), sorted(names - theirs)
    if missing or unexpected:
        raise CheckpointError(f"{WHAT}: the module's tensors do not match hf_model's: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}; pass the model this module was made from")


def export(path: str | os.PathLike, module: torch.nn.Module, *, hf_model: Any = None,
           sync_timeout_s: float = 600.0) -> str:
    """Write the whole model once (collective: call on every rank; rank 0 writes), streamed
    tensor by tensor.

    Without `hf_model`: one torch.save file holding an ordinary state dict (model.load_state_dict
    takes it). With `hf_model` (the Hugging Face model the module was made from, for its config
    and class): a `save_pretrained` directory (config and `model.safetensors`) that
    `from_pretrained` loads with these weights.
    """
    rank, _ = world()
    final = os.path.abspath(os.fspath(path))
    round_no = begin_round()
    begun = exchange(round_no, "begin-export", final, sync_timeout_s, WHAT)
    finish_round()
    if len(set(begun)) > 1:
        raise CheckpointError(f"{WHAT}: ranks passed different paths {sorted(set(begun))}; pass the same path")
    layout = state_layout(module)
    if hf_model is not None:
        _check_hf(hf_model, {n for n, _, _ in layout})
    token = secrets.token_hex(6)
    status = "ok"
    sink: Optional[_Sink] = None
    try:
        if rank == 0:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            sink = _Sink(final, token, layout, hf_model)
    except Exception as e:  # noqa: BLE001 - told to every rank
        status = f"{type(e).__name__}: {e}"
    for names, whole in whole_tensors(module):  # every rank takes part in every tensor's gather
        if sink is not None and status == "ok":
            try:
                for name in names:
                    sink.add(name, whole)
            except Exception as e:  # noqa: BLE001
                status = f"{type(e).__name__}: {e}"
        del whole
    if sink is not None:
        try:
            if status == "ok":
                sink.finish()
        except Exception as e:  # noqa: BLE001
            status = f"{type(e).__name__}: {e}"
        finally:
            sink.cleanup()
    done = exchange(round_no, "done-export", status, sync_timeout_s, WHAT)
    if done[0] != "ok":
        raise CheckpointError(f"{WHAT} to {final} failed on rank 0: {done[0]}")
    return final


class _Sink:
    """Rank 0's output, fed one whole tensor at a time."""

    def __init__(self, final: str, token: str, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                 hf_model: Any):
        self.final, self.token, self.hf_model = final, token, hf_model
        self.layout = {n: (shape, dtype) for n, shape, dtype in layout}
        self.tmp = sibling(final, "saving", token)
        if hf_model is not None:
            os.makedirs(self.tmp)
            self.file = os.path.join(self.tmp, "model.safetensors")
            header, self.offsets = _safetensors_header(layout)
            self.f = open(self.file, "wb")
            self.f.write(header)
        else:
            self.file = self.tmp + ".spill"
            self.f = open(self.file, "wb")
            self.offsets = {}
        self.at = 0

    def add(self, name: str, whole: torch.Tensor) -> None:
        shape, dtype = self.layout[name]
        t = whole.to(dtype).contiguous()
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{name}: made with shape {tuple(t.shape)}, the plan says {shape}")
        if self.hf_model is None:
            pad = -self.at % 64
            self.f.write(bytes(pad))
            self.at += pad
            self.offsets[name] = self.at
        elif self.offsets[name] != self.at:
            raise CheckpointError(f"{name} arrived out of order for the safetensors header")
        if t.numel():
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            self.f.write(data)
            self.at += len(data)

    def finish(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.hf_model is not None:
            self.hf_model.config.save_pretrained(self.tmp)
            if getattr(self.hf_model, "generation_config", None) is not None and \
                    getattr(self.hf_model, "can_generate", lambda: False)():
                self.hf_model.generation_config.save_pretrained(self.tmp)
            for name in os.listdir(self.tmp):
                fsync_file(os.path.join(self.tmp, name))
            fsync_dir(self.tmp)
            swap_into_place(self.tmp, self.final, self.token)
            return
        spill = np.memmap(self.file, dtype=np.uint8, mode="c") if self.at else b""
        state = {}
        for name, offset in self.offsets.items():
            shape, dtype = self.layout[name]
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            state[name] = torch.frombuffer(spill, dtype=dtype, count=n, offset=offset).view(shape) if n else \
                torch.empty(shape, dtype=dtype)
        write_state_dict_file(state, self.final)

    def cleanup(self) -> None:
        if not self.f.closed:
            self.f.close()
        if self.hf_model is None:
            if os.path.exists(self.file):
                os.remove(self.file)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _safetensors_header(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header for tensors written in `layout` order, and where each one starts."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name, shape, dtype in layout:
        if dtype not in _SAFE_NAMES:
            raise CheckpointError(f"{name} has dtype {dtype}, which safetensors cannot store")
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        header[name] = {"dtype": _SAFE_NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        offsets[name] = at
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def exported_state(path: str, device: Optional[str] = "cpu") -> dict[str, torch.Tensor]:
    """An exported state dict file read back (weights only)."""
    return torch.load(path, map_location=device, weights_only=True)
