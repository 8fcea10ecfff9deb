"""What DeepSpeed's ZeRO optimizers put in each rank's `*_optim_states.pt`, built from whole tensors.

DeepSpeed's tools read these files by layout, with no names beside the tensors: `zero_to_fp32`
joins the fp32 partitions of every rank; `ds_to_universal` also cuts each rank's flat optimizer
moments (exp_avg, exp_avg_sq) into per-parameter fragments, by `param_slice_mappings` at ZeRO-1/2
and by `param_shapes` (the model states file) at ZeRO-3. So every flat tensor here is laid out
exactly as DeepSpeed 0.19's `DeepSpeedZeroOptimizer.state_dict()` (stage_1_and_2.py) and
`DeepSpeedZeroOptimizer_Stage3._rigid_state_dict()` (stage3.py) lay theirs out:

ZeRO-1/2  each param group's tensors end to end, padded to a multiple of 2 x dp, cut into dp equal
          partitions; the inner optimizer's state holds the padded partition, the fp32 masters are
          written without the padding (`group_paddings` says how much there was).
ZeRO-3    each tensor padded to a multiple of dp and cut into dp chunks; rank r's chunks end to end.

The fragment addresses are `types.SimpleNamespace(start, numel)` rather than DeepSpeed's
`fragment_address` dataclass (the tools read only those two attributes): the files then load
without DeepSpeed or this package installed.
"""
from __future__ import annotations

import functools
import math
import types
from collections import OrderedDict
from typing import Any, Optional

import torch


def flat_partition_zero12(tensors: list[torch.Tensor], dp: int, dp_rank: int) -> torch.Tensor:
    """Rank `dp_rank`'s slice of the tensors laid end to end, padded to 2 x dp as DeepSpeed's
    ZeRO-1/2 aligns its flat buffers (the padding kept)."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
    align = 2 * dp
    padded = align * math.ceil(flat.numel() / align) if flat.numel() else 0
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    part = padded // dp
    return flat[dp_rank * part:(dp_rank + 1) * part].clone()


def flat_partition_zero3(tensors: list[torch.Tensor], dp: int, dp_rank: int) -> torch.Tensor:
    """ZeRO-3's layout: each tensor padded to a multiple of dp, rank `dp_rank`'s chunk of each."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1).float()
        size = math.ceil(flat.numel() / dp)
        flat = torch.cat([flat, flat.new_zeros(size * dp - flat.numel())])
        parts.append(flat[dp_rank * size:(dp_rank + 1) * size])
    return torch.cat(parts).clone() if parts else torch.zeros(0)


def _group_padding(numel: int, part: int, dp_rank: int) -> int:
    """How much of rank `dp_rank`'s partition is alignment padding (stage_1_and_2.py's rule)."""
    left = dp_rank * part
    if numel <= left:
        return part
    if numel < left + part:
        return left + part - numel
    return 0


def _slice_mappings(names: list[str], shapes: list[torch.Size], part: int, dp_rank: int) -> OrderedDict:
    """Each parameter's fragment in rank `dp_rank`'s partition: where it starts there, how long."""
    out: OrderedDict = OrderedDict()
    lo, hi = dp_rank * part, (dp_rank + 1) * part
    offset = 0
    for name, shape in zip(names, shapes):
        numel = math.prod(shape)
        start, end = max(offset, lo), min(offset + numel, hi)
        if start < end:
            out[name] = types.SimpleNamespace(start=start - lo, numel=end - start)
        offset += numel
    return out


def _split_state(names: list[str], masters: dict[str, torch.Tensor], moments: dict[str, dict]
                 ) -> tuple[list[str], dict[str, Any]]:
    """The group's elementwise state keys (tensors shaped as the parameter) and its scalar values
    (`step`: DeepSpeed's flat optimizer holds one per group)."""
    keys: list[str] = []
    scalars: dict[str, Any] = {}
    for n in names:
        for k, v in moments.get(n, {}).items():
            if k == "master_param":
                continue
            if torch.is_tensor(v) and v.shape == masters[n].shape and v.dim() > 0:
                if k not in keys:
                    keys.append(k)
            elif k not in scalars:
                scalars[k] = v.clone() if torch.is_tensor(v) else v
    return keys, scalars


def _moment(name: str, key: str, masters: dict[str, torch.Tensor], moments: dict[str, dict]) -> torch.Tensor:
    """A parameter's state tensor; zeros where the optimizer holds none for it (it never had a
    gradient), which is what DeepSpeed's flat optimizer holds there."""
    v = moments.get(name, {}).get(key)
    return v if v is not None else torch.zeros(masters[name].shape)


def _inner_state(groups: list[list[str]], masters: dict[str, torch.Tensor], moments: dict[str, dict],
                 hyper: list[dict], flatten: Any) -> dict:
    """The inner torch optimizer's state_dict as DeepSpeed's holds it: one flat parameter per group."""
    state: dict[int, dict] = {}
    for i, names in enumerate(groups):
        keys, scalars = _split_state(names, masters, moments)
        if not keys:
            continue  # no step yet: no optimizer state
        state[i] = {**scalars, **{k: flatten([_moment(n, k, masters, moments) for n in names]) for k in keys}}
    param_groups = [{**(hyper[i] if i < len(hyper) else {}), "params": [i]} for i in range(len(groups))]
    return {"state": state, "param_groups": param_groups}


def zero12_state(groups: list[list[str]], masters: dict[str, torch.Tensor], moments: dict[str, dict],
                 hyper: list[dict], *, stage: int, dp: int, dp_rank: int, clip_grad: float = 0.0) -> dict:
    """`DeepSpeedZeroOptimizer.state_dict()` of rank `dp_rank` (non-elastic, as DeepSpeed saves)."""
    paddings, fp32, mappings = [], [], []
    for names in groups:
        flat = flat_partition_zero12([masters[n] for n in names], dp, dp_rank)
        numel = sum(masters[n].numel() for n in names)
        padding = _group_padding(numel, flat.numel(), dp_rank)
        paddings.append(padding)
        fp32.append(flat[:flat.numel() - padding].clone())
        mappings.append(_slice_mappings(names, [masters[n].shape for n in names], flat.numel(), dp_rank))
    flatten = functools.partial(flat_partition_zero12, dp=dp, dp_rank=dp_rank)
    return {"dynamic_loss_scale": False, "overflow": False, "clip_grad": clip_grad,
            "base_optimizer_state": _inner_state(groups, masters, moments, hyper, flatten),
            "single_partition_of_fp32_groups": fp32, "zero_stage": stage, "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(names) for names in groups],
            "partition_count": [dp] * len(groups), "param_slice_mappings": mappings}


def zero3_state(groups: list[list[str]], masters: dict[str, torch.Tensor], moments: dict[str, dict],
                hyper: list[dict], *, dp: int, dp_rank: int) -> dict:
    """`DeepSpeedZeroOptimizer_Stage3._rigid_state_dict()` of rank `dp_rank` (one sub-group per
    param group, as DeepSpeed forms them below its default sub_group_size)."""
    flatten = functools.partial(flat_partition_zero3, dp=dp, dp_rank=dp_rank)
    return {"zero_stage": 3, "dynamic_loss_scale": False, "overflow": False, "partition_count": dp,
            "optimizer_state_dict": _inner_state(groups, masters, moments, hyper, flatten),
            "fp32_flat_groups": [flatten([masters[n] for n in names]) for names in groups]}


def optimizer_state(groups: list[list[str]], masters: dict[str, torch.Tensor], moments: Optional[dict],
                    hyper: Optional[list], *, zero_stage: int, dp: int, dp_rank: int, clip_grad: float = 0.0) -> dict:
    """The `optimizer_state_dict` of rank `dp_rank`'s optim states file (ZeRO-3 or ZeRO-1/2 form;
    stage 0 with bf16 takes the ZeRO-1 form, which DeepSpeed's readers take for its bf16 optimizer's)."""
    moments, hyper = moments or {}, hyper or []
    if zero_stage >= 3:
        return zero3_state(groups, masters, moments, hyper, dp=dp, dp_rank=dp_rank)
    return zero12_state(groups, masters, moments, hyper, stage=max(zero_stage, 1), dp=dp, dp_rank=dp_rank,
                        clip_grad=clip_grad)
