"""The README's main job, `recipes/train_gpt2.py` (what `bash scripts/main.sh` runs), with its own model.

One launch runs the search on the `local-cpu` cluster (fixed numbers, `--no-measure`, so the plans do
not depend on how busy the machine is; on these numbers `auto` used to pick a plan the code
generator refuses), then trains the main job's tiny GPT-2 (`build_model`, unchanged) under `auto` on
4 processes against one process, next to a strategy that cannot be made. What a person reads is
checked: the model named for its size, each step's loss as it comes, the closing table, and a last
line naming the failing plan and its reason, with exit code 1 and no tracebacks.
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
RECIPE = os.path.join(RECIPES, "train_gpt2.py")


def test_main_job_trains_auto_equal_and_reports_a_failing_plan_on_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, RECIPE, "--no-measure", "--steps", "2", "--strategies", "nosuch,auto",
                           "--out", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    out, err = proc.stdout, proc.stderr
    detail = f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"
    lines = out.splitlines()
    assert proc.returncode == 1, detail
    assert lines[0].startswith("[main job] tiny GPT-2 (2 layers, width 128") and "M parameters" in lines[0], detail
    assert any(line.startswith("[machine] fixed typical CPU numbers") for line in lines), detail
    assert "Pareto frontier" in out and " #0 " in out, detail  # the search ran and printed its table
    assert (tmp_path / "out" / "pareto.svg").exists() and (tmp_path / "out" / "best_plan.json").exists()
    assert [line for line in lines if line.startswith("[one process] step ")][-1].startswith("[one process] step 2/2")
    assert [line for line in lines if line.startswith("[auto] step ")][0].startswith("[auto] step 1/2 loss "), detail
    assert any(line.startswith("[auto] EQUAL") for line in lines), detail
    table = lines.index(next(line for line in lines if line.startswith("plan ") and "verdict" in line))
    assert lines[table + 2].split()[0] == "nosuch" and lines[table + 2].endswith("FAILED"), detail
    assert lines[table + 3].startswith("auto: ") and lines[table + 3].endswith("EQUAL"), detail
    assert lines[-1].startswith("FAILED: plan 'nosuch': PlanError: unknown strategy 'nosuch'"), detail
    assert "auto" not in lines[-1].split("registered:")[0], detail
    assert "MISMATCH" not in out and "Traceback" not in out + err, detail


def test_a_plan_failing_in_the_processes_is_one_line():
    if RECIPES not in sys.path:
        sys.path.insert(0, RECIPES)
    import train_gpt2

    plan = train_gpt2.make_plan("dp", 4, 8, 32)  # made for 4 processes, launched on 2
    losses, error, log = train_gpt2.run_plan(plan, 2, 1, 8, 32, 1e-3, timeout=300)
    assert losses is None and "\n" not in error, error
    assert error.startswith("PlanError: plan is for world size 4"), error
    assert log.count("--- rank") == 2 and "Traceback" in log
