"""Float8 training matmuls: what a converted linear of a `precision="fp8"` plan calls.

torchao's float8 training (`convert_to_float8_training`) swaps each `nn.Linear` for a `Float8Linear`
whose forward casts the input and the weight to float8 with dynamic scales (per tensor, or per row
for the rowwise recipes), multiplies them with the device's float8 matmul, and casts the gradients
likewise in backward. Generated code runs aten ops, not modules, so a converted linear's statement
calls `linear(x, w, b, recipe=..., emulate=...)` here instead, which runs the same autograd
function (`matmul_with_hp_or_float8_args`) with the same configuration torchao builds for the
recipe: the numbers are those of `Float8Linear` on this device's piece of the weight. Under tensor
parallelism each piece is scaled by its own maximum (torchtitan's DTensor path all-reduces the
maximum first); that is at least as accurate and needs no communication.

`emulate=True` runs the float8 products in fp32 from the float8 values (torchao's emulation):
the numbers of a float8 matmul on any device, the CPU included. `float8_matmul_support(device)`
says whether a device multiplies in float8 at all (CUDA compute capability 8.9 or newer); the
runtime refuses a plan that needs it on a device without it, unless emulation was asked for.

Under ZeRO-3 a weight may arrive already in float8 (`WeightCast`: gathered as float8 with the
scale of the whole weight); `linear` multiplies it as it is, as `Float8Linear` does under FSDP2's
float8 all-gather.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from nnscaler_plugins.errors import PlanError


def torchao_missing() -> Optional[str]:
    """Why torchao's float8 training cannot be used here (None when it can)."""
    try:
        from torchao.float8 import Float8LinearConfig  # noqa: F401
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch
        return (f"precision='fp8' runs torchao's float8 training, which is not importable here ({e}); install it "
                "with the torch you have: pip install 'nnscaler-plugins[fp8]' -c <(echo torch==<your torch version>)")
    return None


def float8_matmul_support(device: torch.device) -> Optional[str]:
    """Why `device` has no float8 matmuls (None when it has them: CUDA compute capability >= 8.9)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the {device.type} device has no float8 matmul units"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 matmul "
                "units (they start at 8.9: Ada, Hopper, Blackwell)")
    return None


def check_float8(device: torch.device, emulate: bool) -> None:
    """Refuse, before any step, a float8 plan this device cannot run: torchao missing, or a device
    without float8 matmuls when emulation was not asked for."""
    missing = torchao_missing()
    if missing:
        raise PlanError(missing)
    why = float8_matmul_support(device)
    if why and not emulate:
        raise PlanError(f"precision='fp8': {why}. Run it on such a GPU, or pass fp8_emulate=True to compute the "
                        "float8 products in fp32 from float8 values (the same numbers, without the speed)")


_CONFIGS: dict[tuple[str, bool], tuple[Any, Any]] = {}  # made once per recipe (a plain dict: torch.compile reads it)


def _configs(recipe: str, emulate: bool) -> tuple[Any, Any]:
    """torchao's configuration of `recipe` and the matmul configuration `Float8Linear` derives from it."""
    found = _CONFIGS.get((recipe, emulate))
    if found is not None:
        return found
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
                          for g in gemms))
    _CONFIGS[(recipe, emulate)] = (config, mm)
    return config, mm


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           recipe: str = "tensorwise", emulate: bool = False) -> torch.Tensor:
    """`aten.linear(input, weight, bias)` with its products in float8 (forward and backward), as
    torchao's `Float8Linear` computes it: in the autocast dtype when autocast is on."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    config, mm = _configs(recipe, emulate)
    kind = input.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else input.dtype
    with torch.autocast(kind, enabled=False):
        w = weight if is_float8(weight) else weight.to(dtype)  # gathered in float8: multiplied as it is
        out = matmul_with_hp_or_float8_args.apply(input.to(dtype), w.t(), mm, config)
        if bias is not None:
            out = out + bias.to(out.dtype)
    return out


def is_float8(t: torch.Tensor) -> bool:
    """Whether `t` is already a float8 operand (a weight gathered in float8), not a high-precision one."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(t, Float8TrainingTensor)


class WeightCast:
    """The weight cast of `recipe` (tensorwise: one scale per weight) split in the steps a float8
    all-gather takes (torchao's FSDP float8 all-gather): `scales` from each weight's maximum |w|
    over all its chunks, `cast` of one chunk with its weight's scale (elementwise, so the chunks
    cast are the chunks of the whole weight cast), and `operand`, the gathered float8 values as
    the operand `linear` multiplies without casting again (forward and backward)."""

    def __init__(self, recipe: str = "tensorwise", emulate: bool = False) -> None:
        if recipe != "tensorwise":
            raise PlanError(f"a float8 all-gather needs one scale per weight: fp8_recipe={recipe!r} scales per row "
                            "(use fp8_recipe='tensorwise')")
        self.recipe, self.emulate = recipe, emulate
        config, self._mm = _configs(recipe, emulate)
        self.dtype: torch.dtype = config.cast_config_weight.target_dtype
        self._round = config.round_scales_to_power_of_2

    def scales(self, amax: torch.Tensor) -> torch.Tensor:
        """torchao's scales (fp32) of weights whose largest magnitudes are `amax` (one per weight)."""
        from torchao.float8.float8_utils import amax_to_scale

        return amax_to_scale(amax.float(), self.dtype, self._round)

    def cast(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`t` (a chunk of a weight) in float8 with its weight's `scale`, as torchao casts the weight."""
        from torchao.float8.float8_utils import to_fp8_saturated

        return to_fp8_saturated(t.to(torch.float32) * scale, self.dtype)

    def operand(self, data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype) -> torch.Tensor:
        """Gathered float8 values (`data`, any strides) with their scale, as `linear`'s weight."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, orig_dtype, self._mm, gemm_input_role=GemmInputRole.WEIGHT)

    @staticmethod
    def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """(float8 values, scale, high-precision dtype) of an operand `operand` made."""
        return t._data, t._scale, t._orig_dtype
