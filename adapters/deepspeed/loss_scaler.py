"""fp16 loss scaling with DeepSpeed's rules (runtime/fp16/loss_scaler.py), config keys included.

The plan's optimizer has a dynamic scaler of its own; DeepSpeed's differs in hysteresis (by default
the first overflow only skips the step, the second halves the scale), in when the scale grows
(after `loss_scale_window` clean steps counted from the last overflow) and in offering a static
scale (`loss_scale` > 0). The engine puts this one in its place so fp16 runs follow the config.
"""
from __future__ import annotations


class DeepSpeedLossScaler:
    """`update(overflow)` after every optimizer step, `scale` to multiply the loss by."""

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0,
                 scale_factor: float = 2.0):
        self.dynamic = loss_scale == 0
        self.scale = float(loss_scale) if not self.dynamic else float(2 ** initial_scale_power)
        self.window = int(loss_scale_window)
        self.delayed_shift = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_loss_scale)
        self.factor = float(scale_factor)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore "
                                       "(fp16.min_loss_scale); the loss or gradients are not finite")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = (self.cur_iter - self.last_overflow_iter) - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items()}

    def load_state_dict(self, state: dict) -> None:
        if "cur_iter" not in state:  # a checkpoint from the plan's own scaler: keep its scale
            self.scale = float(state["scale"])
            return
        for k, v in state.items():
            setattr(self, k, v)
