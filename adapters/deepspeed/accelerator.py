"""`deepspeed.accelerator.get_accelerator()`: the device calls DeepSpeed scripts make through it.

Scripts ask it where tensors go (`device_name()`, `current_device_name()`), which dtypes to train
in (`is_bf16_supported()`), and for memory and RNG calls. Here it answers for the device this
engine runs on: the first CUDA device of the process when torch sees one, else the CPU (over
gloo). What it reports is what this engine supports on that device (on the CPU it trains bf16 and
fp16 alike).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch


class Accelerator:
    """DeepSpeed's accelerator interface for CUDA or the CPU (the calls training scripts use)."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._compile_backend = "inductor"

    # which device
    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: Optional[int] = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: Optional[int] = None) -> Any:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", 0)) or 1

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def visible_devices_envs(self) -> list:
        return ["CUDA_VISIBLE_DEVICES"] if self._name == "cuda" else []

    # dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        out = [torch.float]
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        if self.is_fp16_supported():
            out.append(torch.half)
        return out

    def is_triton_supported(self) -> bool:
        return False

    # random numbers
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._name == "cuda" else torch.default_generator

    # streams (the CPU has none: calls are no-ops, as in DeepSpeed's CPU accelerator)
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._name == "cuda" else None

    def stream(self, stream: Any) -> Any:
        import contextlib

        return torch.cuda.stream(stream) if self._name == "cuda" else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._name == "cuda" else None

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._name == "cuda" else None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._name == "cuda" else None

    # memory
    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: Optional[int] = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: Optional[int] = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else 0

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else 0

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return torch.cuda.memory_stats(device_index) if self._name == "cuda" else {}

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # profiling ranges
    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    # compiling
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend


_ACCELERATOR: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process (one object, as DeepSpeed's)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR


def set_accelerator(accel: Union[Accelerator, Any]) -> None:
    """Replace the accelerator object scripts get (DeepSpeed's hook for custom accelerators)."""
    global _ACCELERATOR
    _ACCELERATOR = accel


def is_current_accelerator_supported() -> bool:
    return True
