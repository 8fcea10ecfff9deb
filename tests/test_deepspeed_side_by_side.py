"""The same DeepSpeed script and configs under real DeepSpeed and under this project's engine.

The recipe `recipes/deepspeed_swap/train.py` is run twice with `torchrun --nproc_per_node 2` (gloo):
once as it is, once with its import line swapped for `import deepspeed` -- the only change a user
makes. One launch per engine loops over ZeRO stages 0-3, each with and without gradient
accumulation (2 micro-batches, gradient clipping 0.5) and with DeepSpeed's WarmupLR, plus SGD with
momentum without a scheduler, plus bf16 under ZeRO-2 (the model in bf16 with fp32 master weights in
both engines) and host-memory offload of parameters and optimizer under ZeRO-3 (with
NNS_TEST_ALL_PLANS=1 also bf16 under ZeRO-0 and optimizer offload under ZeRO-2); 10 optimizer steps
each. Every micro-batch's loss must agree (fp32 to 1e-5 relative, bf16 within one unit of bf16's
last place), as must the final lr, the step count and (where DeepSpeed reports it) the gradient norm.

DeepSpeed is only a reference here (skipped when it is not installed). Its shared-memory comm
kernel would be JIT-compiled on first use (minutes on a small CPU); the DeepSpeed side switches it
off, which leaves DeepSpeed on plain gloo collectives, as this engine is.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
RECIPE = ROOT / "recipes" / "deepspeed_swap" / "train.py"
OUR_IMPORT = "from nnscaler_plugins.adapters import deepspeed"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="real DeepSpeed is the reference; pip install 'deepspeed>=0.19,<0.20'")

DRIVER = '''
import json, os, sys
if sys.argv[1] == "deepspeed":
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build: plain gloo collectives
sys.path.insert(0, sys.argv[2])
import train
out, configs = sys.argv[3], json.load(open(sys.argv[4]))
rank = int(os.environ["RANK"])
results = {}
for name, cfg in configs.items():
    path = os.path.join(out, f"{name}.rank{rank}.json")
    json.dump(cfg, open(path, "w"))
    r = train.main(["--deepspeed_config", path, "--steps", "10"])
    results[name] = {k: (float(v) if hasattr(v, "item") else v) for k, v in r.items()}
json.dump(results, open(os.path.join(out, f"rank{rank}.json"), "w"))
'''


def _configs() -> dict:
    base = {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
            "steps_per_print": 1000}
    out = {}
    for stage in (0, 1, 2, 3):
        for acc in (1, 2):
            cfg = json.loads(json.dumps(base))
            cfg["zero_optimization"] = {"stage": stage}
            cfg["gradient_accumulation_steps"] = acc
            if acc == 2:
                cfg["gradient_clipping"] = 0.5  # without it DeepSpeed's default of 1.0 applies: both are compared
            out[f"zero{stage}_accum{acc}"] = cfg
    # a torch optimizer by name, no scheduler, DeepSpeed's default clipping (1.0)
    out["zero1_accum2_sgd"] = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
                               "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
                               "zero_optimization": {"stage": 1},
                               "zero_allow_untested_optimizer": True}  # DeepSpeed's ZeRO wants it for SGD
    # bf16: DeepSpeed's bf16 engine holds the model in bf16 (fp32 master weights) and returns bf16 losses
    for stage in ((0, 2) if ALL else (2,)):
        cfg = json.loads(json.dumps(base))
        cfg.update(zero_optimization={"stage": stage}, gradient_accumulation_steps=1, bf16={"enabled": True})
        out[f"zero{stage}_bf16"] = cfg
    # host-memory offload: the optimizer (ZeRO-2), the parameters too (ZeRO-3); torch's Adam on the host
    # (DeepSpeed's own CPU Adam would be JIT-compiled, and it insists on it unless told not to)
    offloads = [(3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})]
    if ALL:
        offloads.append((2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}))
    for stage, section in offloads:
        cfg = json.loads(json.dumps(base))
        cfg.update(zero_optimization={"stage": stage, **section}, gradient_accumulation_steps=1,
                   zero_force_ds_cpu_optimizer=False)
        out[f"zero{stage}_offload"] = cfg
    return out


def _tolerance(name: str, x: float) -> float:
    """fp32: rounding only. bf16: the model runs in bf16 (8 bits of mantissa) in both engines, whose
    kernels round differently (autocast here, pure bf16 there): losses agree within one bf16 unit
    (measured: the first step's loss is identical, at most 8e-5 relative over 10 steps)."""
    return 2.0 ** -8 * abs(x) if name.endswith("bf16") else 1e-5 * abs(x)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(engine: str, script_dir: Path, out: Path, configs: Path) -> dict:
    driver = out / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_BUILD_OPS="0", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(driver), engine, str(script_dir), str(out), str(configs)]
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{engine} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_same_losses_as_deepspeed_for_zero_0_to_3(tmp_path: Path) -> None:
    source = RECIPE.read_text()
    assert source.count(OUR_IMPORT) == 1
    ds_dir = tmp_path / "as_deepspeed"
    ds_dir.mkdir()
    (ds_dir / "train.py").write_text(source.replace(OUR_IMPORT, "import deepspeed"))
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps(_configs()))
    (tmp_path / "ds_out").mkdir()
    (tmp_path / "our_out").mkdir()

    theirs = _launch("deepspeed", ds_dir, tmp_path / "ds_out", configs)
    ours = _launch("nnscaler", RECIPE.parent, tmp_path / "our_out", configs)

    for rank in (0, 1):
        for name in _configs():
            a, b = theirs[rank][name], ours[rank][name]
            acc = _configs()[name]["gradient_accumulation_steps"]
            assert len(a["losses"]) == len(b["losses"]) == 10 * acc
            for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
                assert abs(x - y) <= _tolerance(name, x), f"{name} rank {rank} micro-step {step}: DeepSpeed {x}, ours {y}"
            assert b["global_steps"] == a["global_steps"] == 10, name
            assert b["lr"] == pytest.approx(a["lr"], rel=1e-6), name
            if a.get("grad_norm") is not None:  # DeepSpeed reports it for ZeRO stages only
                assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2 if name.endswith("bf16") else 1e-4), name
        # the losses of the two ranks differ: each trains on its own micro-batches, as in DeepSpeed
        assert ours[rank]["zero0_accum1"]["losses"] != ours[1 - rank]["zero0_accum1"]["losses"]
