"""A transformers example script, run as its users run it: tests/run_clm_offline.py (written like
transformers' run_clm.py) is copied with one line added, which swaps the imported `Trainer` and
`TrainingArguments` for the adapter's classes, and launched through its command line under
`torch.distributed.run` on gloo processes. Its logged training losses and evaluation loss equal the
unchanged script's on one process reading the same global batch (per-device batch x data-parallel
replicas), and so do the numbers the Trainer logs about the run: the total train batch size (per
replica x replicas x accumulation, not x processes: the devices of one replica read the same rows),
update steps per epoch, optimization steps, epochs, samples and tokens seen.

The default suite runs tensor parallelism with accumulation; NNS_TEST_ALL_PLANS=1 adds dp, a pipeline,
ZeRO-3, tp with a rank-aware sampler, tp x dp on four processes, and arguments from JSON and YAML files
(each case about 40-70 s on 2 cores).
"""
from __future__ import annotations

import difflib
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "run_clm_offline.py")
ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
AFTER = "from transformers.trainer_utils import get_last_checkpoint\n"
SWAP = ("from nnscaler_plugins.adapters.hf import NNScalerTrainer as Trainer, "
        "NNScalerTrainingArguments as TrainingArguments\n")
# What the Trainer logs under "***** Running training *****" that must not depend on how a replica is split.
LOGGED = ("Num examples", "Num Epochs", "Num update steps per epoch",
          "Total train batch size (w. parallel, distributed & accumulation)", "Gradient Accumulation steps",
          "Total optimization steps")
COMMON = ["--do_train", "--do_eval", "--use_cpu", "--report_to", "none", "--seed", "0", "--logging_steps", "1",
          "--save_strategy", "no", "--disable_tqdm", "true", "--learning_rate", "1e-3",
          "--lr_scheduler_type", "constant", "--include_num_input_tokens_seen", "true"]
RTOL = 1e-5


def swapped_copy(tmp_path) -> str:
    """The example with `Trainer` and `TrainingArguments` swapped, and nothing else changed."""
    with open(SCRIPT) as f:
        source = f.read()
    assert source.count(AFTER) == 1
    swapped = source.replace(AFTER, AFTER + SWAP)
    changed = [d for d in difflib.ndiff(source.splitlines(), swapped.splitlines()) if d[:2] in ("+ ", "- ")]
    assert changed == ["+ " + SWAP.strip()], changed
    path = tmp_path / "run_clm_nnscaler.py"
    path.write_text(swapped)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    losses: list[float]
    eval_loss: float
    logged: dict[str, int]
    tokens_seen: int
    samples: float  # the Trainer's sample count behind train_samples_per_second


def run_script(script: str, out: str, nproc: int, args: list[str], eval_refusal: str = "") -> Run:
    """Launch `script`; with `eval_refusal`, its evaluation (after training and saving) must fail
    with that message."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore")
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                  str(nproc), "--master-port", str(_free_port())]
    argv = args if len(args) == 1 else ["--output_dir", out, *args]  # one argument: a .json or .yaml file
    proc = subprocess.run(launch + [script, *argv], env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    if eval_refusal:
        assert proc.returncode != 0 and eval_refusal in text, f"evaluation was not refused:\n{text[-8000:]}"
        assert "*** Evaluate ***" in text  # refused at evaluation, after training and saving
    else:
        assert proc.returncode == 0, f"{os.path.basename(script)} failed ({proc.returncode}):\n{text[-8000:]}"
    block = text[text.index("***** Running training *****"):].splitlines()[1:12]
    logged = {}
    for name in LOGGED:
        found = [m for line in block if (m := re.search(re.escape(name) + r" = ([\d,]+)\s*$", line))]
        assert len(found) == 1, f"{name!r} is not logged once in:\n" + "\n".join(block)
        logged[name] = int(found[0].group(1).replace(",", ""))
    with open(os.path.join(out, "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    with open(os.path.join(out, "train_results.json")) as f:
        train = json.load(f)
    eval_loss = float("nan")
    if not eval_refusal:
        with open(os.path.join(out, "eval_results.json")) as f:
            eval_loss = json.load(f)["eval_loss"]
    return Run(losses, eval_loss, logged, train["num_input_tokens_seen"],
               train["train_samples_per_second"] * train["train_runtime"])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def check_against_one_process(tmp_path, nproc: int, dp: int, per_device: int, args: list[str],
                              plan_args: list[str], files: str = "", eval_refusal: str = "") -> None:
    """The swapped script on `nproc` processes (`dp` replicas of `per_device` rows) against the plain
    script on one process with `per_device * dp` rows. `files` ("json" / "yaml") gives the planned
    run's arguments as one file instead of a command line."""
    eval_bs = 2
    ref = run_script(SCRIPT, str(tmp_path / "reference"), 1,
                     COMMON + args + ["--per_device_train_batch_size", str(per_device * dp),
                                      "--per_device_eval_batch_size", str(eval_bs * dp)])
    planned_args = COMMON + args + ["--per_device_train_batch_size", str(per_device),
                                    "--per_device_eval_batch_size", str(eval_bs), "--ddp_backend", "gloo"] + plan_args
    out = str(tmp_path / "planned")
    if files:
        planned_args = [_write_args_file(tmp_path, files, ["--output_dir", out, *planned_args])]
    got = run_script(swapped_copy(tmp_path), out, nproc, planned_args, eval_refusal)

    assert len(got.losses) == len(ref.losses) == ref.logged["Total optimization steps"] > 1
    bad = [(i, g, r) for i, (g, r) in enumerate(zip(got.losses, ref.losses)) if not _close(g, r)]
    assert not bad, f"logged losses differ from one process's (step, planned, one process): {bad}"
    assert eval_refusal or _close(got.eval_loss, ref.eval_loss), (got.eval_loss, ref.eval_loss)
    assert got.logged == ref.logged, f"logged run numbers differ:\n planned {got.logged}\n one process {ref.logged}"
    accumulate = ref.logged["Gradient Accumulation steps"]
    assert got.logged["Total train batch size (w. parallel, distributed & accumulation)"] == per_device * dp * accumulate
    assert got.tokens_seen == ref.tokens_seen
    assert abs(got.samples - ref.samples) <= 0.02 * ref.samples, (got.samples, ref.samples)


def _write_args_file(tmp_path, kind: str, argv: list[str]) -> str:
    """A command line as the argument file a script takes instead (`parse_json_file` / `parse_yaml_file`):
    flags without a value are true, --plan_options becomes a mapping."""
    args: dict = {}
    i = 0
    while i < len(argv):
        key = argv[i][2:]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value, i = "true", i + 1
        args[key] = json.loads(value) if key == "plan_options" else value
    for key, value in list(args.items()):
        if isinstance(value, str) and value in ("true", "false"):
            args[key] = value == "true"
        elif isinstance(value, str) and re.fullmatch(r"-?\d+", value):
            args[key] = int(value)
        elif isinstance(value, str) and re.fullmatch(r"-?\d+(\.\d*)?(e-?\d+)?", value):
            args[key] = float(value)
    path = tmp_path / f"args.{kind}"
    if kind == "json":
        path.write_text(json.dumps(args))
    else:
        import yaml

        path.write_text(yaml.safe_dump(args))
    return str(path)


def test_example_script_under_tp_with_accumulation(tmp_path):
    """Two processes, one replica: the Trainer's total batch is per-device x 1 x accumulation."""
    check_against_one_process(tmp_path, nproc=2, dp=1, per_device=4,
                              args=["--num_train_epochs", "1", "--max_train_samples", "32",
                                    "--gradient_accumulation_steps", "2", "--max_eval_samples", "7"],
                              plan_args=["--plan", "tp", "--plan_options", '{"tp": 2}'])


# With several replicas the evaluation set is a whole number of global batches: accelerate pads a last
# uneven batch with rows from the start, whose losses then enter that batch's mean (as under DDP).
EVEN = ["--max_eval_samples", "8"]
SWEEP = {
    # name: (processes, replicas, per-device rows, script arguments, plan arguments, argument file)
    "dp": (2, 2, 2, ["--max_steps", "3", "--gradient_accumulation_steps", "2", *EVEN], ["--plan", "dp"], ""),
    # A pipeline has no forward pass to evaluate with: the script's evaluation is refused by name.
    "1f1b": (2, 1, 4, ["--num_train_epochs", "1", "--max_train_samples", "24"],
             ["--plan", "1f1b", "--plan_options", '{"pp": 2, "micro_batches": 2}'], ""),
    "zero3": (2, 2, 2, ["--num_train_epochs", "1", "--max_train_samples", "24", "--gradient_accumulation_steps", "2",
                        *EVEN], ["--plan", "zero3"], "json"),
    "tp-batch-rebalance": (2, 1, 4, ["--max_steps", "3", "--train_sampling_strategy", "batch_rebalance",
                                     "--gradient_accumulation_steps", "2"], ["--plan", "tp"], "yaml"),
    "tp2-dp2": (4, 2, 2, ["--max_steps", "3", "--gradient_accumulation_steps", "2", *EVEN],
                ["--plan", "tp", "--plan_options", '{"tp": 2}'], ""),
}


@pytest.mark.skipif(not ALL, reason="about a minute a case on 2 cores; NNS_TEST_ALL_PLANS=1")
@pytest.mark.parametrize("case", sorted(SWEEP))
def test_example_script_sweep(tmp_path, case):
    nproc, dp, per_device, args, plan_args, files = SWEEP[case]
    if "batch_rebalance" in args:
        from transformers import trainer_pt_utils

        if not hasattr(trainer_pt_utils, "BatchRebalanceSampler"):
            pytest.skip("this transformers has no batch_rebalance sampler")
    refusal = "plan '1f1b' runs whole training steps (a pipeline), so it has no forward pass" if case == "1f1b" else ""
    check_against_one_process(tmp_path, nproc, dp, per_device, args, plan_args, files, refusal)
