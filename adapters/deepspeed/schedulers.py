"""DeepSpeed's learning-rate schedules, with DeepSpeed's formulas (runtime/lr_schedules.py, 0.19).

Like DeepSpeed's, they count optimizer steps (`last_batch_iteration`), set the lr on construction
and on every `step()`, and keep only `last_batch_iteration` in their state dict, so a checkpoint of
either engine restores the other's schedule position. Names DeepSpeed does not know fall back to
`torch.optim.lr_scheduler.<name>`, as in DeepSpeed.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import torch

from .errors import DeepSpeedConfigError
from .param_types import check_param_types

LOG, LINEAR = "log", "linear"


def _number(value: Any) -> Any:
    """A learning rate held as a tensor (torch allows one, e.g. for capturable optimizers), as the
    number the schedule computes with."""
    return value.item() if isinstance(value, torch.Tensor) else value


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name}, got {len(value)}")
        return [_number(v) for v in value]
    return [_number(value)] * len(optimizer.param_groups)


def _set_lr(optimizer: torch.optim.Optimizer, lrs: list) -> list:
    for group, lr in zip(optimizer.param_groups, lrs):
        lr = _number(lr)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # the tensor stays the one the optimizer holds
        else:
            group["lr"] = lr
    return [g["lr"] for g in optimizer.param_groups]


def _warmup_type(kind: str) -> str:
    if kind not in (LOG, LINEAR):
        warnings.warn(f"scheduler warmup_type {kind!r} is unknown; DeepSpeed uses 'log' then, and so does this engine",
                      stacklevel=3)
        return LOG
    return kind


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


class _Schedule:
    """Shared state handling: one integer position, DeepSpeed's state-dict layout."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int
    _last_lr: Optional[list] = None

    def get_lr(self) -> list:
        raise NotImplementedError

    def get_last_lr(self) -> list:
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = _set_lr(self.optimizer, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Schedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG, last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.get_lr())

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        return self._warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = LOG,
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """A ratio of the optimizer's own lr: warmup_min_ratio -> 1 over the warmup, then a cosine
    down to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = LOG,
                 last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)
        self.org_lrs = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                        for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == LOG:
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        r = self.get_lr_ratio()
        return [lr * r for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """lr = min_lr x (1 + step_rate x interval), interval continuous or a staircase."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: Any = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.min_lr)

    def get_lr(self) -> list:
        x = float(self.last_batch_iteration + 1) / self.step_size
        interval = math.floor(x) if self.staircase else x
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


class OneCycle(_Schedule):
    """One triangle cycle of lr (and inverse momentum), then optional decay; DeepSpeed's formulas
    including its staircase."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: Any, cycle_max_lr: Any,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: float = 2000,
                 cycle_second_step_size: Optional[float] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: float = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8, cycle_max_mom: Any = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _set_lr(optimizer, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "betas" not in optimizer.defaults:
                warnings.warn(f"cycle_momentum is disabled because {type(optimizer).__name__} has no betas",
                              stacklevel=2)
                self.cycle_momentum = False
            else:
                self.decay_mom_rate = decay_mom_rate
                self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
                self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
                if last_batch_iteration == -1:
                    for mom, group in zip(self.min_moms, optimizer.param_groups):
                        group["betas"] = mom
                if math.isclose(decay_mom_rate, 0):
                    self.skip_mom_decay = True
        self.last_batch_iteration = last_batch_iteration

    def _scale_factor(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        factor = 1 + self.decay_lr_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[list]:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        factor = 1 + self.decay_mom_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: Optional[int] = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = mom


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def check_scheduler_section(name: Any, params: dict) -> None:
    if not isinstance(name, str):
        raise DeepSpeedConfigError(f"scheduler.type must be a name, got {name!r}")
    cls = SCHEDULES.get(name) or getattr(torch.optim.lr_scheduler, name, None)
    if callable(cls):
        check_param_types(cls, params, "scheduler.params")
    if name in SCHEDULES:
        import inspect

        accepted = set(inspect.signature(SCHEDULES[name]).parameters) - {"optimizer"}
        unknown = sorted(set(params) - accepted)
        if unknown:
            raise DeepSpeedConfigError(f"scheduler.params {unknown} are not parameters of {name} "
                                       f"(it takes {sorted(accepted)})")
        for key in ("warmup_num_steps", "lr_range_test_step_size"):
            if key in params and (isinstance(params[key], bool) or not isinstance(params[key], int)
                                  or params[key] <= 0):
                raise DeepSpeedConfigError(f"scheduler.params.{key} must be a positive integer, got {params[key]!r}")
        return
    if not hasattr(torch.optim.lr_scheduler, name):
        raise DeepSpeedConfigError(f"scheduler.type {name!r} is neither one of DeepSpeed's schedules "
                                   f"({', '.join(SCHEDULES)}) nor a torch.optim.lr_scheduler class")


def build_scheduler(name: str, params: dict, optimizer: torch.optim.Optimizer) -> Any:
    check_scheduler_section(name, params)
    cls = SCHEDULES.get(name) or getattr(torch.optim.lr_scheduler, name)
    try:
        return cls(optimizer, **params)
    except TypeError as e:
        raise DeepSpeedConfigError(f"scheduler {name}: {e}") from None
