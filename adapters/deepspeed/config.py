"""Reading a DeepSpeed JSON config into this engine's settings, with DeepSpeed's meaning.

Everything that can be checked without processes is checked here, so a bad config fails in
`initialize` with a message naming the key, before any model is captured or any rank waits on another.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from . import keys as K
from .errors import DeepSpeedAssertion, DeepSpeedConfigError  # noqa: F401 - importable from here as before
from .errors import DeepSpeedNotImplemented

AUTO = "auto"


@dataclass
class Settings:
    """What the engine needs from a config. Batch sizes may still be None: the triple is completed
    by `resolve_batch` once the data-parallel size is known."""

    train_batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    optimizer: Optional[dict] = None          # {"type": str, "params": dict}
    scheduler: Optional[dict] = None          # {"type": str, "params": dict}
    precision: str = "fp32"                   # "fp32" | "bf16" | "fp16"
    loss_scale: dict = field(default_factory=dict)  # the fp16 section's scaling keys
    zero_stage: int = 0
    gradient_clipping: float = 1.0            # DeepSpeed's default (runtime/constants.py), not 0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False
    managed_gradient_accumulation: bool = True
    offload: Optional[str] = None             # the plan's offload: None | "optimizer" | "params"
    skip_nonfinite_steps: bool = False       # bf16.check_grad_overflow (DeepSpeed's default true); fp16 always
    client_optimizer_refused: bool = False    # offload_optimizer with zero_force_ds_cpu_optimizer (DeepSpeed's default)
    tag_validation: str = "WARN"              # checkpoint.tag_validation: IGNORE | WARN | FAIL
    load_universal: bool = False              # checkpoint.load_universal: load_checkpoint reads a universal folder
    allgather_bucket_size: int = 500_000_000
    plan: Any = "dp"
    plan_options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def load_config(config: Union[str, os.PathLike, dict, None], config_params: Optional[dict] = None,
                args: Any = None) -> dict:
    """The config dict from `config`, the legacy `config_params`, or `args.deepspeed_config`, in
    DeepSpeed's order of precedence."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise DeepSpeedConfigError("a config was given both as config= and as args.deepspeed_config; give one")
    config = config if config is not None else from_args
    if config is None:
        raise DeepSpeedConfigError("no DeepSpeed config: pass config= (a dict or a JSON file) or "
                                   "args.deepspeed_config (see add_config_arguments)")
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a private deep copy; the caller's dict stays as it is
    path = os.fspath(config)
    if not os.path.isfile(path):
        text = _base64_config(path)
        if text is None:
            raise DeepSpeedConfigError(f"DeepSpeed config file {path!r} does not exist (a config is a dict, a path to "
                                       "a JSON or hjson file, or the file's text in base64)")
        return _parse(text, "the base64 config")
    with open(path) as f:
        return _parse(f.read(), f"DeepSpeed config file {path!r}")


def _no_duplicates(pairs: list) -> dict:
    """DeepSpeed refuses a key given twice (a JSON reader would keep the last one silently)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: dict = {}
        for k, _ in pairs:
            seen[k] = seen.get(k, 0) + 1
        raise ValueError("Duplicate keys in DeepSpeed config: {}".format([k for k, n in seen.items() if n > 1]))
    return d


def _parse(text: str, what: str) -> dict:
    """JSON, or hjson (comments, unquoted keys, trailing commas) as DeepSpeed reads its files."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:
            raise DeepSpeedConfigError(f"{what} is not valid JSON ({json_error}); DeepSpeed also reads hjson, which "
                                       "needs the 'hjson' package: pip install hjson (or the deepspeed extra)") from None
        try:
            return hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as e:
            raise DeepSpeedConfigError(f"{what} is neither valid JSON nor hjson: {e}") from None


def _base64_config(value: str) -> Optional[str]:
    import base64
    import binascii

    try:
        return base64.urlsafe_b64decode(value).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def translate(config: dict) -> Settings:
    """Check every key against the tables in `keys` and read what is accepted."""
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(f"a DeepSpeed config is a JSON object, got {type(config).__name__}")
    _check_keys(config)
    s = Settings()
    s.train_batch_size = _batch_value(config, "train_batch_size")
    s.micro_batch_size = _batch_value(config, "train_micro_batch_size_per_gpu")
    s.gradient_accumulation_steps = _batch_value(config, "gradient_accumulation_steps")
    s.optimizer = _optimizer_section(config.get("optimizer"))
    s.scheduler = _scheduler_section(config.get("scheduler"))
    s.precision, s.loss_scale = _precision(config)
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    s.skip_nonfinite_steps = s.precision == "bf16" and _flag(bf16, "check_grad_overflow", True, "bf16.")
    _check_grad_accum_dtype(config.get("data_types") or {}, s.precision)
    s.zero_stage = _zero_stage(config.get("zero_optimization") or {})
    s.offload = _offload(config.get("zero_optimization") or {}, s.zero_stage)
    zero = config.get("zero_optimization") or {}
    optimizer_offloaded = _offload_device(zero, "offload_optimizer") == "cpu" or bool(zero.get("cpu_offload"))
    s.client_optimizer_refused = (s.zero_stage > 0 and optimizer_offloaded
                                  and _flag(config, "zero_force_ds_cpu_optimizer", True))
    s.gradient_clipping = _number(config, "gradient_clipping", 1.0,
                                  auto_hint="the HF Trainer fills it from max_grad_norm; give a number (0 = off)")
    s.steps_per_print = int(_number(config, "steps_per_print", 10, auto_hint="give a number"))
    s.wall_clock_breakdown = _flag(config, "wall_clock_breakdown", False)
    s.dataloader_drop_last = _flag(config, "dataloader_drop_last", False)
    s.managed_gradient_accumulation = _flag(config, "managed_gradient_accumulation", True)
    s.tag_validation = _tag_validation(config.get("checkpoint") or {})
    s.load_universal = _load_universal(config.get("checkpoint") or {})
    s.allgather_bucket_size = int((config.get("zero_optimization") or {}).get("allgather_bucket_size", 5e8))
    _check_reduction_keys(config)
    s.plan, s.plan_options = _nnscaler_section(config.get("nnscaler"))
    if _flag(config.get("compile") or {}, "deepcompile", False, "compile."):
        s.plan_options.setdefault("compile", True)  # the per-rank program under torch.compile
    return s


def _flag(section: dict, key: str, default: bool, prefix: str = "") -> bool:
    """A true/false key: a string such as "false" is refused, not read by its truth (it would be true)."""
    v = section.get(key, default)
    if not isinstance(v, bool):
        raise DeepSpeedConfigError(f"{prefix}{key}={v!r}: must be true or false, not a {type(v).__name__}")
    return v


def _section(value: Any, where: str) -> dict:
    """A nested object of the config (an empty one when absent)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"{where} must be an object, got {value!r}")
    return value


def _check_keys(config: dict) -> None:
    removed = [k for k in config if k in K.REMOVED_TOP_LEVEL]
    if removed:
        raise DeepSpeedConfigError(f"config keys {removed} were removed from DeepSpeed in 0.19 (DeepSpeed refuses "
                                   "them too); delete them")
    _check_table(config, K.TOP_LEVEL, "")
    for name, table in K.SECTIONS.items():
        section = config.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise DeepSpeedConfigError(f"config key {name!r} must be an object, got {section!r}")
        _check_table(section, table, name + ".")


def _check_table(section: dict, table: dict, prefix: str) -> None:
    unknown = [prefix + k for k in section if k not in table]
    if unknown:
        raise DeepSpeedConfigError(f"unknown DeepSpeed config key(s) {unknown}: this engine does not know them, so "
                                   "it will not guess; remove them or check their spelling")
    refused = [(prefix + k, table[k][1]) for k in section if table[k][0] == K.REFUSE]
    if refused:
        raise DeepSpeedConfigError("unsupported DeepSpeed config key(s): "
                                   + "; ".join(f"{k} ({why})" for k, why in refused))
    switched_on = [(prefix + k, table[k][1]) for k in section if table[k][0] == K.OFF_ONLY
                   and _switched_on(section[k], prefix + k)]
    if switched_on:
        raise DeepSpeedConfigError("DeepSpeed feature(s) enabled that this engine does not run (set enabled to false "
                                   "or remove the section): "
                                   + "; ".join(f"{k} ({why})" for k, why in switched_on))
    warned = [(prefix + k, table[k][1]) for k in section if table[k][0] == K.WARN]
    if warned:
        warnings.warn("DeepSpeed config key(s) accepted without effect in this engine: "
                      + "; ".join(f"{k} ({why})" for k, why in warned), stacklevel=4)


def _switched_on(value: Any, where: str) -> bool:
    """Whether a feature section (keys.OFF_ONLY) asks for its feature: an `enabled` true anywhere in
    it (compression_training switches each technique on in its own `shared_parameters`). Absent
    `enabled` is false, DeepSpeed's default for every such section."""
    if not isinstance(value, dict):
        raise DeepSpeedConfigError(f"config key {where!r} must be an object, got {value!r}")
    for key, v in value.items():
        if key == "enabled":
            if v == AUTO:
                raise DeepSpeedConfigError(f"{where}.enabled: 'auto' cannot be resolved outside a trainer; give true "
                                           "or false")
            if not isinstance(v, bool):
                raise DeepSpeedConfigError(f"{where}.enabled={v!r}: must be true or false, not a {type(v).__name__}")
            if v:
                return True
        elif isinstance(v, dict) and _switched_on(v, f"{where}.{key}"):
            return True
    return False


def _batch_value(config: dict, key: str) -> Optional[int]:
    v = config.get(key)
    if v is None or v == AUTO:  # "auto": derived from the other two, as the HF Trainer would
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise DeepSpeedConfigError(f"{key} must be a positive integer, got {v!r}")
    return v


def resolve_batch(s: Settings, dp_size: int) -> None:
    """Complete the batch triple as DeepSpeed does and check train = micro x accumulation x dp."""
    train, micro, acc = s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps
    if train is not None and micro is not None and acc is not None:
        pass
    elif train is not None and micro is not None:
        acc = train // micro // dp_size
    elif train is not None and acc is not None:
        micro = train // dp_size // acc
    elif micro is not None and acc is not None:
        train = micro * acc * dp_size
    elif train is not None:
        acc, micro = 1, train // dp_size
    elif micro is not None:
        acc, train = 1, micro * dp_size
    else:
        raise DeepSpeedAssertion("the config needs train_batch_size or train_micro_batch_size_per_gpu (a number; "
                                 "'auto' only works where a trainer fills it in)")
    if micro < 1 or acc < 1 or train != micro * acc * dp_size:
        raise DeepSpeedAssertion(
            f"inconsistent batch sizes: train_batch_size={train} must equal train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={acc} x data-parallel size {dp_size} (= {micro * acc * dp_size}); fix one "
            "of them or leave one out to have it derived")
    s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps = train, micro, acc


def _number(config: dict, key: str, default: float, auto_hint: str) -> float:
    v = config.get(key, default)
    if v == AUTO:
        raise DeepSpeedConfigError(f"{key}: 'auto' cannot be resolved outside a trainer; {auto_hint}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise DeepSpeedConfigError(f"{key} must be a non-negative number, got {v!r}")
    return v


# Values the HF Trainer writes for "auto" optimizer parameters when its own arguments keep their
# defaults; they are also DeepSpeed's Adam defaults. The learning rate has no such default.
_AUTO_OPTIMIZER_PARAMS = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _optimizer_section(section: Any) -> Optional[dict]:
    if section is None:
        return None
    if not isinstance(section, dict) or "type" not in section:
        raise DeepSpeedConfigError(f"optimizer must be {{'type': ..., 'params': {{...}}}}, got {section!r}")
    extra = [k for k in section if k not in ("type", "params")]
    if extra:
        raise DeepSpeedConfigError(f"unknown key(s) {['optimizer.' + k for k in extra]}; an optimizer section holds "
                                   "'type' and 'params'")
    params = dict(_section(section.get("params"), "optimizer.params"))
    for k, v in list(params.items()):
        if v == AUTO:
            if k not in _AUTO_OPTIMIZER_PARAMS:
                raise DeepSpeedConfigError(f"optimizer.params.{k}: 'auto' cannot be resolved outside a trainer; "
                                           "give a value")
            params[k] = _AUTO_OPTIMIZER_PARAMS[k]
    from .optimizers import check_optimizer_section  # noqa: PLC0415 - keeps the optimizer table in one place
    check_optimizer_section(section["type"], params)
    return {"type": section["type"], "params": params}


def _scheduler_section(section: Any) -> Optional[dict]:
    if section is None:
        return None
    if not isinstance(section, dict) or "type" not in section:
        raise DeepSpeedConfigError(f"scheduler must be {{'type': ..., 'params': {{...}}}}, got {section!r}")
    extra = [k for k in section if k not in ("type", "params")]
    if extra:
        raise DeepSpeedConfigError(f"unknown key(s) {['scheduler.' + k for k in extra]}; a scheduler section holds "
                                   "'type' and 'params'")
    params = dict(_section(section.get("params"), "scheduler.params"))
    for k, v in list(params.items()):
        if v != AUTO:
            continue
        if k == "warmup_min_lr":
            params[k] = 0.0  # what the HF Trainer writes
        elif k == "warmup_max_lr":
            params[k] = None  # the optimizer's lr, which the HF Trainer writes too
        else:
            raise DeepSpeedConfigError(f"scheduler.params.{k}: 'auto' cannot be resolved outside a trainer (it needs "
                                       "the number of training steps); give a number")
    from .schedulers import check_scheduler_section  # noqa: PLC0415
    check_scheduler_section(section["type"], params)
    return {"type": section["type"], "params": params}


def _enabled(config: dict, name: str) -> bool:
    section = config.get(name) or {}
    v = section.get("enabled", False)
    if v == AUTO:
        raise DeepSpeedConfigError(f"{name}.enabled: 'auto' cannot be resolved outside a trainer; give true or false")
    return _flag(section, "enabled", False, f"{name}.")


def _precision(config: dict) -> tuple[str, dict]:
    fp16 = _enabled(config, "fp16")
    bf16 = _enabled(config, "bf16") or _enabled(config, "bfloat16")
    if fp16 and bf16:
        raise DeepSpeedConfigError("fp16.enabled and bf16.enabled are both true; enable one")
    for name, key in (("fp16", "auto_cast"), ("fp16", "fp16_master_weights_and_grads"),
                      ("bf16", "bf16_master_weights_and_grads"), ("bf16", "bf16_optimizer_states"),
                      ("bfloat16", "bf16_master_weights_and_grads"), ("bfloat16", "bf16_optimizer_states")):
        if (config.get(name) or {}).get(key):
            raise DeepSpeedConfigError(f"{name}.{key}=true is not supported: master weights and optimizer states "
                                       "are kept in fp32 here; set it to false")
    scale = {}
    if fp16:
        section = config["fp16"]
        _check_loss_scale(section)
        scale = {"loss_scale": float(section.get("loss_scale", 0.0)),
                 "initial_scale_power": int(section.get("initial_scale_power", 16)),
                 "loss_scale_window": int(section.get("loss_scale_window", 1000)),
                 "hysteresis": int(section.get("hysteresis", 2)),
                 "consecutive_hysteresis": _flag(section, "consecutive_hysteresis", False, "fp16."),
                 "min_loss_scale": float(section.get("min_loss_scale", 1.0))}
    return ("fp16" if fp16 else "bf16" if bf16 else "fp32"), scale


# DeepSpeed's names of dtypes (its DtypeEnum) as this engine's precisions.
_DTYPE_NAMES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
                **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
                **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16")}


def _check_grad_accum_dtype(section: dict, precision: str) -> None:
    """data_types.grad_accum_dtype: gradients accumulate in the model's dtype here, so only that
    (or unset) runs exactly; another dtype is refused with the NotImplementedError DeepSpeed raises
    for the combinations it does not support."""
    value = section.get("grad_accum_dtype")
    if value is None:
        return
    wanted = _DTYPE_NAMES.get(str(value).lower())
    if wanted is None:
        raise DeepSpeedConfigError(f"data_types.grad_accum_dtype={value!r} is not a dtype DeepSpeed knows; give "
                                   "'fp32', 'bf16' or 'fp16'")
    if wanted != precision:
        raise DeepSpeedNotImplemented(f"unsupported mix of model dtype {precision} and data_types.grad_accum_dtype="
                                      f"{value!r}: gradients accumulate in the model's dtype here; leave "
                                      f"grad_accum_dtype unset or give {precision!r}")


def _check_loss_scale(section: dict) -> None:
    """The values DeepSpeed's loss scaler validates (finite scales, positive window and floor)."""
    import math

    checks = [("loss_scale", lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0 (0 = dynamic)"),
              ("initial_scale_power", lambda v: float(v).is_integer() and 0 <= v < 128,
               "must be an integer in [0, 128) (2**power must be a finite fp32 scale)"),
              ("loss_scale_window", lambda v: v > 0, "must be > 0"),
              ("hysteresis", lambda v: float(v).is_integer() and v >= 1, "must be an integer >= 1"),
              ("min_loss_scale", lambda v: math.isfinite(v) and v > 0, "must be finite and > 0")]
    for key, ok, what in checks:
        if key not in section:
            continue
        v = section[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise DeepSpeedConfigError(f"fp16.{key} {what}, got {v!r}")


def _zero_stage(section: dict) -> int:
    _check_zero_values(section)
    stage = section.get("stage", 0)
    if stage == AUTO:  # DeepSpeed drops "auto" zero values and keeps the default
        stage = 0
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if section.get(key):
            raise DeepSpeedConfigError(f"zero_optimization.{key}=true is not supported; set it to false")
    if section.get("zero_hpz_partition_size", 1) not in (1, AUTO):
        raise DeepSpeedConfigError("zero_optimization.zero_hpz_partition_size > 1 (hierarchical partitioning) is not "
                                   "supported; set it to 1")
    return int(stage)


_TAG_MODES = ("IGNORE", "WARN", "FAIL")


def _tag_validation(section: dict) -> str:
    mode = section.get("tag_validation", "Warn")
    if not isinstance(mode, str) or mode.upper() not in _TAG_MODES:
        raise DeepSpeedConfigError(f"Checkpoint config contains invalid tag_validation value of "
                                   f"{mode.upper() if isinstance(mode, str) else mode}, expecting one "
                                   f"of {list(_TAG_MODES)}")
    return mode.upper()


def _load_universal(section: dict) -> bool:
    """checkpoint.load_universal: load_checkpoint then reads what DeepSpeed's ds_to_universal writes
    (this engine's own checkpoints load under any plan or world size without it). DeepSpeed takes
    any value by its truth, unchecked; so does this."""
    return bool(section.get("load_universal", False))


def _check_zero_values(section: dict) -> None:
    """The value checks DeepSpeed's zero_optimization model makes (types and bounds)."""
    from . import keys as keys_table

    for key, value in section.items():
        kind = keys_table.ZERO_VALUE_TYPES.get(key)
        if kind is None or value == AUTO or value is None:
            continue
        if kind == "bool":
            if not isinstance(value, bool):
                raise DeepSpeedConfigError(f"zero_optimization.{key} must be true or false, got {value!r}")
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
        if not number:
            raise DeepSpeedConfigError(f"zero_optimization.{key} must be an integer, got {value!r}")
        if (kind == "int>0" and value <= 0) or (kind == "int>=0" and value < 0):
            bound = "> 0" if kind == "int>0" else ">= 0"
            raise DeepSpeedConfigError(f"zero_optimization.{key} must be {bound}, got {value!r}")


_OFFLOAD_KEYS = {"offload_optimizer": ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                       "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
                                       "pipeline"),
                 "offload_param": ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")}


def _offload_device(section: dict, key: str) -> str:
    sub = section.get(key)
    if sub is None:
        return "none"
    if not isinstance(sub, dict):
        raise DeepSpeedConfigError(f"zero_optimization.{key} must be an object such as {{'device': 'cpu'}}, got {sub!r}")
    unknown = [f"zero_optimization.{key}.{k}" for k in sub if k not in _OFFLOAD_KEYS[key]]
    if unknown:
        raise DeepSpeedConfigError(f"unknown DeepSpeed config key(s) {unknown}")
    device = sub.get("device", "none")
    device = "none" if device is None else str(device)
    if device == "nvme":
        raise DeepSpeedConfigError(f"zero_optimization.{key}.device='nvme': NVMe offload is not supported; use 'cpu' "
                                   "(host memory) or 'none'")
    if device not in ("none", "cpu"):
        raise DeepSpeedConfigError(f"zero_optimization.{key}.device={device!r}: choose 'none', 'cpu' or 'nvme'")
    return device


def _offload(section: dict, stage: int) -> Optional[str]:
    """DeepSpeed's offload sections as the plan's host-memory offload: optimizer state and step on
    the host ("optimizer"), and under ZeRO-3 the parameter chunks too ("params"). pin_memory and
    the buffer sizes tune DeepSpeed's copies and are accepted."""
    optimizer = _offload_device(section, "offload_optimizer") == "cpu" or bool(section.get("cpu_offload"))
    params = _offload_device(section, "offload_param") == "cpu" or bool(section.get("cpu_offload_param"))
    if params and stage != 3:  # DeepSpeed offloads parameters only under ZeRO-3 and ignores the section otherwise
        warnings.warn(f"zero_optimization.offload_param has effect only under ZeRO stage 3 (this config has stage "
                      f"{stage}), as in DeepSpeed; it is ignored", stacklevel=4)
        params = False
    if params:
        return "params"
    return "optimizer" if optimizer else None


def _check_reduction_keys(config: dict) -> None:
    if _flag(config, "prescale_gradients", False):
        raise DeepSpeedConfigError("prescale_gradients=true is not supported; set it to false")
    if config.get("gradient_predivide_factor", 1.0) != 1.0:
        raise DeepSpeedConfigError("gradient_predivide_factor other than 1.0 is not supported")
    if config.get("gradient_allreduce_op", "mean") != "mean":
        raise DeepSpeedConfigError("gradient_allreduce_op other than 'mean' is not supported")
    dtype = config.get("communication_data_type")
    if dtype not in (None, "fp32", "float32"):
        raise DeepSpeedConfigError(f"communication_data_type={dtype!r} is not supported; gradients are reduced in "
                                   "their own dtype (leave it out or use 'fp32')")


def _nnscaler_section(section: Any) -> tuple[Any, dict]:
    if section is None:
        return "dp", {}
    if isinstance(section, str):
        return section, {}
    if not isinstance(section, dict):
        raise DeepSpeedConfigError(f"'nnscaler' must be an object such as {{'plan': 'tp'}}, got {section!r}")
    options = dict(section)
    plan = options.pop("plan", "dp")
    if "micro_batches" in options or "micro_batch_size" in options:
        raise DeepSpeedConfigError("nnscaler.micro_batches: a pipeline's micro-batches are the config's "
                                   "gradient_accumulation_steps; remove it")
    taken = [k for k in ("zero", "precision") if k in options]
    if taken:
        raise DeepSpeedConfigError(f"nnscaler.{taken[0]}: the config's own sections set it (zero_optimization.stage, "
                                   "bf16 / fp16); remove it from the nnscaler section")
    return plan, options  # the plan and its option names are checked once, by `plan_session`
