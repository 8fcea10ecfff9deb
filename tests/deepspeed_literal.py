"""DeepSpeed's own engine tests, run unmodified on DeepSpeed and through a literal import swap.

    NNS_DEEPSPEED_REPO=/path/to/DeepSpeed python tests/deepspeed_literal.py both
    python tests/deepspeed_literal.py report

The test files are DeepSpeed's (`FILES`, those `deepspeed_conformance_inventory.md` counts), taken
from a DeepSpeed checkout at run time (`NNS_DEEPSPEED_REPO`: a work tree, or a bare git directory
with `NNS_DEEPSPEED_REV`, default HEAD); nothing of DeepSpeed's is kept in this repository. They
are copied twice into a temporary directory:

- "real": as they are, run on the DeepSpeed installed here (its CPU accelerator, gloo);
- "swap": every `import deepspeed` / `from deepspeed... import ...` in the test files and the
  helpers they share (simple_model.py, checkpoint/common.py, ...) rewritten to this project's
  drop-in (`from nnscaler_plugins.adapters import deepspeed`, `from
  nnscaler_plugins.adapters.deepspeed.runtime.lr_schedules import WarmupLR`, ...). A name the
  drop-in does not have stays imported from DeepSpeed (they are DeepSpeed's internal classes the
  tests name, e.g. `FP16_UnfusedOptimizer`); `left_to_deepspeed` in the results lists them. A test
  that uses such a class against the drop-in's engine fails on its merits.

DeepSpeed's harness (tests/conftest.py, tests/unit/common.py with `DistributedTest`, which spawns
the processes, and tests/unit/util.py) is not rewritten: it starts the process group (gloo) and
checks the environment, as it does for DeepSpeed.

Each test's outcome on each side goes to `deepspeed_literal_results.json` beside this file, with
a per-file table (`report`): passing on DeepSpeed, passing through the swap, the ratio. The
percentage counts, of the tests passing on real DeepSpeed, those passing through the swap;
`EXEMPT` lists the tests of DeepSpeed's internals that no drop-in can satisfy, each with its
reason, and the report gives the figure with and without them.

`tests/test_deepspeed_literal.py` runs a default subset of the swap side (all of it with
NNS_TEST_ALL_PLANS=1) when `NNS_DEEPSPEED_REPO` is set.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "deepspeed_literal_results.json"
DROP_IN = "nnscaler_plugins.adapters.deepspeed"

# DeepSpeed's engine test files (paths under its tests/unit), those the inventory counts.
FILES = [
    "runtime/test_ds_initialize.py",
    "runtime/test_ds_config_dict.py",
    "runtime/test_no_sync_ctxt.py",
    "runtime/test_data.py",
    "runtime/test_lr_schedulers.py",
    "v1/zero/test_zero.py",
    "runtime/zero/test_zero_context.py",
    "runtime/half_precision/test_zero_optim_overflow.py",
    "checkpoint/test_zero_optimizer.py",
    "checkpoint/test_other_optimizer.py",
    "checkpoint/test_latest_checkpoint.py",
    "checkpoint/test_tag_validation.py",
    "checkpoint/test_shared_weights.py",
    "checkpoint/test_convert_checkpoint.py",
    "checkpoint/test_pipeline.py",
]
# DeepSpeed's harness: run as it is on both sides.
HARNESS = {"conftest.py", "unit/common.py", "unit/util.py"}

# Tests (id prefixes) of DeepSpeed's internals that no drop-in can satisfy, with the reason; they
# stay in the table, and the report gives the percentage with and without them.
EXEMPT: dict[str, str] = {
    "unit/runtime/zero/test_zero_context.py::TestSerialContext::test_throughput_calculation":
        "reads engine.tput_timer, DeepSpeed's ThroughputTimer object (its batch size and timing fields); "
        "the drop-in has no such object",
}

# Tests per pytest run (a run also ends early when DeepSpeed's harness exits on a hung test).
CHUNK = 20

# Results of one side: {test id: [outcome, message]}, outcome in passed / failed / skipped / hung.
Outcomes = dict[str, list]


# -- the test files --------------------------------------------------------------------------------------

def extract(repo: str, dest: Path, rev: str = "HEAD") -> None:
    """DeepSpeed's tests/ directory from a checkout (work tree or bare git directory) into dest/tests."""
    src = Path(repo)
    if (src / "tests" / "unit" / "common.py").exists():
        shutil.copytree(src / "tests", dest / "tests")
        return
    git = ["git", f"--git-dir={repo}"]
    listing = subprocess.run(git + ["ls-tree", "-r", "-z", rev, "--", "tests"], check=True,
                             capture_output=True).stdout.decode().split("\0")
    blobs = [(line.split("\t", 1)[1], line.split()[2]) for line in listing if line and line.split()[1] == "blob"]
    proc = subprocess.run(git + ["cat-file", "--batch"], input="".join(f"{sha}\n" for _, sha in blobs).encode(),
                          check=True, capture_output=True)
    out, pos = proc.stdout, 0
    for path, sha in blobs:
        header_end = out.index(b"\n", pos)
        header = out[pos:header_end].split()
        if header[1] == b"missing":
            pos = header_end + 1
            continue
        size = int(header[2])
        body = out[header_end + 1:header_end + 1 + size]
        pos = header_end + 1 + size + 1
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(body)
    if not (dest / "tests" / "unit" / "common.py").exists():
        raise FileNotFoundError(f"{repo} (rev {rev}) has no tests/unit/common.py: not a DeepSpeed repository")


def _drop_in_has(module: str, name: Optional[str] = None) -> bool:
    """Whether the drop-in has `deepspeed.<module>` (and `name` in it: an attribute or submodule)."""
    full = DROP_IN + (f".{module}" if module else "")
    try:
        mod = importlib.import_module(full)
    except ImportError:
        return False
    if name is None:
        return True
    if hasattr(mod, name):
        return True
    try:
        return importlib.util.find_spec(f"{full}.{name}") is not None
    except ImportError:
        return False


def _rewrite_import(node: ast.stmt, left: list) -> Optional[list[str]]:
    """The statements that replace one import statement of deepspeed (None: not one)."""
    out = []
    if isinstance(node, ast.Import):
        if not any(a.name == "deepspeed" or a.name.startswith("deepspeed.") for a in node.names):
            return None
        for a in node.names:
            if a.name == "deepspeed":
                alias = f" as {a.asname}" if a.asname else ""
                out.append(f"from {DROP_IN.rsplit('.', 1)[0]} import deepspeed{alias}")
            elif a.name.startswith("deepspeed."):
                sub = a.name[len("deepspeed."):]
                parent, _, last = sub.rpartition(".")
                if not _drop_in_has(sub):
                    left.append(a.name)
                    out.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
                elif a.asname:
                    out.append(f"from {DROP_IN}{'.' + parent if parent else ''} import {last} as {a.asname}")
                else:  # `import deepspeed.x` binds `deepspeed`: the drop-in, with its submodule imported
                    out.append(f"import {DROP_IN}.{sub}")
                    out.append(f"from {DROP_IN.rsplit('.', 1)[0]} import deepspeed")
            else:
                out.append(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
        return out
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
            node.module == "deepspeed" or node.module.startswith("deepspeed.")):
        sub = node.module[len("deepspeed."):] if node.module != "deepspeed" else ""
        ours, theirs = [], []
        for a in node.names:
            text = a.name + (f" as {a.asname}" if a.asname else "")
            if a.name != "*" and _drop_in_has(sub, a.name):
                ours.append(text)
            elif a.name == "*" and _drop_in_has(sub):
                ours.append(text)
            else:
                theirs.append(text)
                left.append(f"{node.module}.{a.name}")
        if ours:
            out.append(f"from {DROP_IN}{'.' + sub if sub else ''} import {', '.join(ours)}")
        if theirs:
            out.append(f"from {node.module} import {', '.join(theirs)}")
        return out
    return None


def swap_source(source: str, left: list) -> str:
    """`source` with its deepspeed imports pointed at the drop-in (names it lacks stay DeepSpeed's)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            new = _rewrite_import(node, left)
            if new is not None:
                edits.append((node.lineno, node.end_lineno, node.col_offset, new))
    for start, end, col, new in sorted(edits, reverse=True):
        indent = lines[start - 1][:col]
        # one line, statements joined by ';': the rest of the file keeps its line numbers
        text = indent + "; ".join(new) + "\n"
        lines[start - 1:end] = [text] + ["\n"] * (end - start)
    return "".join(lines)


def swap(tests: Path, files: Iterable[str]) -> list[str]:
    """Rewrite the test files and the helper modules beside them (every python file under tests/unit
    not named test_*, except the harness); returns the names left to DeepSpeed."""
    left: list[str] = []
    chosen = {f"unit/{f}" for f in files}
    for path in sorted((tests / "unit").rglob("*.py")):
        rel = path.relative_to(tests).as_posix()
        if rel in HARNESS or (path.name.startswith("test_") and rel not in chosen):
            continue
        source = path.read_text()
        if "deepspeed" not in source:
            continue
        try:
            path.write_text(swap_source(source, left))
        except SyntaxError:
            continue
    return sorted(set(left))


# -- running -------------------------------------------------------------------------------------------

PLUGIN = '''
import json, os, time
OUT = os.environ.get("NNS_LITERAL_OUT", os.devnull)

def pytest_collection_finish(session):
    if os.environ.get("NNS_LITERAL_COLLECT"):
        with open(os.environ["NNS_LITERAL_COLLECT"], "w") as f:
            f.write("\\n".join(item.nodeid for item in session.items) + "\\n")

def _write(rec):
    with open(OUT, "a") as f:
        f.write(json.dumps(rec) + "\\n")

def pytest_runtest_logstart(nodeid, location):
    _write({"id": nodeid, "event": "start", "t": time.time()})

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        msg = ""
        if report.longrepr is not None:
            msg = str(getattr(report.longrepr, "reprcrash", None) and report.longrepr.reprcrash.message
                      or report.longrepr)[-600:]
        if report.skipped and isinstance(report.longrepr, tuple):
            msg = str(report.longrepr[2])[-300:]
        _write({"id": report.nodeid, "event": report.when, "outcome": report.outcome, "msg": msg,
                "t": time.time(), "duration": report.duration})
'''


def _read_events(path: Path) -> Outcomes:
    out: Outcomes = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "start":
            out.setdefault(rec["id"], ["hung", "started, never finished"])
            continue
        cur = out.get(rec["id"])
        if rec["outcome"] == "passed":
            if cur is None or cur[0] == "hung":
                out[rec["id"]] = ["passed", ""]
        elif rec["outcome"] == "skipped":
            out[rec["id"]] = ["skipped", rec["msg"]]
        else:  # a failure in setup, call or teardown
            out[rec["id"]] = ["failed", f"[{rec['event']}] {rec['msg']}"]
    return out


def collect(tests: Path, files: Iterable[str], env: dict) -> list[str]:
    """The test ids pytest collects from these files (DeepSpeed's own selection markers apply)."""
    listing = tests.parent / "collected.txt"
    listing.unlink(missing_ok=True)
    env = _with_plugin(tests, dict(env, NNS_LITERAL_COLLECT=str(listing)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "nns_literal_plugin", "-p",
                           "no:cacheprovider", "--color=no", *[f"unit/{f}" for f in files]], cwd=tests, env=env,
                          capture_output=True, text=True)
    if not listing.exists():
        raise RuntimeError(f"collecting DeepSpeed's tests failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return listing.read_text().split()


def _with_plugin(tests: Path, env: dict) -> dict:
    plugin_dir = tests.parent / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "nns_literal_plugin.py").write_text(PLUGIN)
    return dict(env, PYTHONPATH=os.pathsep.join([str(plugin_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def run_side(tests: Path, ids: list[str], out: Path, env: dict, per_test_timeout: int,
             log: Optional[Path] = None) -> Outcomes:
    """Run `ids` (in chunks per file); a hang or a harness exit ends one pytest run: the rest rerun."""
    env = _with_plugin(tests, dict(env, NNS_LITERAL_OUT=str(out), DS_UNITTEST_TIMEOUT=str(per_test_timeout)))
    todo = list(ids)
    while todo:
        done = _read_events(out)
        todo = [i for i in todo if i not in done]
        if not todo:
            break
        while (tests.parent.parent / "PAUSE").exists():  # lets the machine be shared between chunks
            time.sleep(10)
        chunk = todo[:CHUNK]
        argfile = tests.parent / "ids.txt"
        argfile.write_text("\n".join(chunk) + "\n")
        cmd = [sys.executable, "-m", "pytest", "-p", "nns_literal_plugin", "-p", "no:cacheprovider", "--color=no",
               "-q", f"@{argfile}"]
        with open(log or os.devnull, "a") as sink:
            proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=per_test_timeout * len(chunk) + 120)
            except subprocess.TimeoutExpired:
                pass
            finally:  # the harness's worker processes too
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        after = _read_events(out)
        progressed = [i for i in chunk if i in after]
        if not progressed:  # nothing ran (a collection error): record it and go on
            for i in chunk:
                after.setdefault(i, ["failed", "not run: pytest collected nothing (see the log)"])
            with open(out, "a") as f:
                for i in chunk:
                    f.write(json.dumps({"id": i, "event": "call", "outcome": "failed",
                                        "msg": after[i][1], "t": time.time(), "duration": 0}) + "\n")
    return {i: v for i, v in _read_events(out).items() if i in set(ids)}


# -- the report -----------------------------------------------------------------------------------------

def _file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0].removeprefix("unit/")


def exempt_reason(test_id: str) -> Optional[str]:
    for prefix, why in EXEMPT.items():
        if test_id.startswith(prefix):
            return why
    return None


def table(results: dict) -> str:
    """Per file: tests passing on DeepSpeed; of them, those exempt (DeepSpeed's internals); the rest,
    counted; of those, passing through the swap; the ratio (and the ratio over all, exempt included)."""
    real, swapped = results.get("real", {}), results.get("swap", {})
    rows = ["| file | passing on DeepSpeed | exempt (internal) | counted | passing through the swap | ratio "
            "| ratio over all |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    tot = [0, 0, 0, 0, 0]
    for f in FILES:
        ids = [i for i, (o, _) in real.items() if _file_of(i) == f and o == "passed"]
        ok = {i for i in ids if swapped.get(i, ["missing"])[0] == "passed"}
        ex = [i for i in ids if exempt_reason(i)]
        counted = [i for i in ids if not exempt_reason(i)]
        ok_counted = [i for i in counted if i in ok]
        tot = [tot[0] + len(ids), tot[1] + len(ex), tot[2] + len(counted), tot[3] + len(ok_counted), tot[4] + len(ok)]
        rows.append(f"| {f} | {len(ids)} | {len(ex)} | {len(counted)} | {len(ok_counted)} | "
                    f"{_pct(len(ok_counted), len(counted))} | {_pct(len(ok), len(ids))} |")
    rows.append(f"| **total** | **{tot[0]}** | **{tot[1]}** | **{tot[2]}** | **{tot[3]}** | **{_pct(tot[3], tot[2])}** "
                f"| {_pct(tot[4], tot[0])} |")
    return "\n".join(rows)


def _pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f} %" if b else "-"


def failures(results: dict) -> list[tuple[str, str, Optional[str]]]:
    """Tests passing on DeepSpeed and not through the swap: (id, the swap's message, exempt reason)."""
    real, swapped = results.get("real", {}), results.get("swap", {})
    out = []
    for i, (o, _) in sorted(real.items()):
        if o == "passed" and swapped.get(i, ["missing"])[0] != "passed":
            out.append((i, " ".join(str(swapped.get(i, ["missing", "not run"])[1]).split())[:300], exempt_reason(i)))
    return out


# -- main -----------------------------------------------------------------------------------------------

def write_section(results: dict, path: Path) -> None:
    """Append a dated section with the table and what still fails to benchmarks/RESULTS.md."""
    date = subprocess.run(["date", "+%Y-%m-%d"], capture_output=True, text=True).stdout.strip()
    import torch

    try:
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:  # noqa: BLE001 - only the label
        ds = "?"
    lines = ["", "## tests/deepspeed_literal.py: DeepSpeed's own engine tests, unmodified on DeepSpeed and through "
             "the import swap", "",
             f"{date}, torch {torch.__version__}, DeepSpeed {ds} (CPU accelerator, gloo), test files of "
             f"{results.get('source', 'a DeepSpeed checkout')}", "", table(results), "",
             "Passing on DeepSpeed and not through the swap (exempt ones marked):", ""]
    for i, msg, why in failures(results):
        lines.append(f"- `{i}`: " + (f"exempt, {why}" if why else msg))
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def environment() -> dict:
    """The environment the test runs get: one thread per process, DeepSpeed's CPU device count."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOCAL_SIZE", "4")  # DeepSpeed's CPU accelerator counts devices from it (else NUMA nodes)
    env.pop("NNS_TEST_ALL_PLANS", None)
    return env


def source_label() -> str:
    """DeepSpeed's repository and revision the test files come from."""
    repo = os.environ.get("NNS_DEEPSPEED_REPO", "")
    rev = os.environ.get("NNS_DEEPSPEED_REV", "HEAD")
    git = ["git", f"--git-dir={repo}"] if not (Path(repo) / ".git").exists() else ["git", "-C", repo]
    sha = subprocess.run(git + ["rev-parse", rev], capture_output=True, text=True).stdout.strip()
    return f"deepspeedai/DeepSpeed {sha[:12] or rev}"


def prepare(workdir: Path, side: str, files: Iterable[str]) -> tuple[Path, list[str]]:
    """DeepSpeed's tests/ under workdir/<side>/ (swapped for "swap"); kept from an earlier run there."""
    repo = os.environ.get("NNS_DEEPSPEED_REPO")
    if not repo:
        raise SystemExit("set NNS_DEEPSPEED_REPO to a DeepSpeed checkout (work tree or bare git directory)")
    root = workdir / side
    done = root / "prepared.json"
    if done.exists():
        return root / "tests", json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    extract(repo, root, os.environ.get("NNS_DEEPSPEED_REV", "HEAD"))
    left = swap(root / "tests", files) if side == "swap" else []
    done.write_text(json.dumps(left))
    return root / "tests", left


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("side", choices=["real", "swap", "both", "report"])
    ap.add_argument("--files", nargs="*", default=None, help="DeepSpeed test files (paths under tests/unit)")
    ap.add_argument("-k", dest="match", default=None, help="only test ids containing this text")
    ap.add_argument("--only-real-passing", action="store_true",
                    help="swap side: run only the tests recorded as passing on DeepSpeed")
    ap.add_argument("--skip-real-failing", action="store_true",
                    help="swap side: leave out the tests recorded as failing or skipped on DeepSpeed")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test before it counts as hung")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--write", action="store_true", help="report: append the table to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    results_path = Path(args.results)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.side == "report":
        print(table(results))
        for i, msg, why in failures(results):
            print(f"- {i}: {why or msg}")
        if args.write:
            write_section(results, HERE.parent / "benchmarks" / "RESULTS.md")
        return 0
    files = args.files or FILES
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ds_literal_"))
    for side in (["real", "swap"] if args.side == "both" else [args.side]):
        tests, left = prepare(workdir, side, files)
        results["source"] = source_label()
        env = environment()
        ids = collect(tests, files, env)
        if args.match:
            ids = [i for i in ids if args.match in i]
        if side == "swap" and args.only_real_passing:
            passing = {i for i, (o, _) in results.get("real", {}).items() if o == "passed"}
            ids = [i for i in ids if i in passing]
        if side == "swap" and args.skip_real_failing:
            failing = {i for i, (o, _) in results.get("real", {}).items() if o != "passed"}
            ids = [i for i in ids if i not in failing]
        out = workdir / f"{side}.jsonl"
        got = run_side(tests, ids, out, env, args.timeout, log=workdir / f"{side}.log")
        results.setdefault(side, {}).update(got)
        if left:
            results["left_to_deepspeed"] = left
        results_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{side}: {sum(o == 'passed' for o, _ in got.values())} of {len(got)} passed "
              f"(log: {workdir / (side + '.log')})", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
