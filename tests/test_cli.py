"""`nnscaler-plan` as a person uses it: one way to name the model, the plan's own cluster by
default, `explain` in rounded numbers with units, and `search --out` that replaces an earlier
search's files without mixing or touching anyone else's."""
from __future__ import annotations

import json
import re

import pytest

from nnscaler_plugins.cli import main as cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import GPT2Config

    d = tmp_path_factory.mktemp("model")
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
               eos_token_id=0).save_pretrained(d)
    return str(d)


def search(model_dir, out, n=16, extra=()):
    return cli(["search", "--model", model_dir, "-n", str(n), "--cluster", "a100-dgx", "--global-batch", "32",
                "--seq", "64", "--no-progress", "--out", str(out), *extra])


def test_search_explain_simulate_with_the_plan_cluster(model_dir, tmp_path, capsys):
    out = tmp_path / "plans"
    assert search(model_dir, out) == 0
    table = capsys.readouterr().out
    assert re.search(r"#0 +[\d.]+ (µs|ms|s) +[\d.]+ (KiB|MiB|GiB) +\S", table), table
    assert "group " not in table and "[greedy]" not in table  # plans in words, not the solver's notation
    plan0 = str(out / "plan_0.json")
    assert cli(["explain", plan0]) == 0
    text = capsys.readouterr().out
    assert "searched for a100-dgx" in text and "estimate on a100-dgx: step " in text
    assert not re.search(r"\d\.\d{6,}", text), text  # rounded, not 17-digit floats
    assert "{" not in text
    assert cli(["simulate", plan0, "--model", model_dir]) == 0
    got = capsys.readouterr()
    assert "the cluster the plan was searched for" in got.err and "estimate on a100-dgx" in got.out


def test_old_positional_model_still_works_with_a_note(model_dir, tmp_path, capsys):
    assert cli(["search", model_dir, "-n", "8", "--cluster", "a100-dgx", "--global-batch", "16", "--seq", "64",
                "--no-progress"]) == 0
    assert "deprecated; use --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["search", "-n", "8", "--cluster", "a100-dgx"])


def test_search_out_replaces_an_earlier_search_and_refuses_foreign_plan_files(model_dir, tmp_path, capsys):
    out = tmp_path / "plans"
    assert search(model_dir, out, n=16) == 0
    (out / "notes.txt").write_text("mine")
    first = json.loads((out / "nnscaler-search.json").read_text())["files"]
    assert search(model_dir, out, n=2) == 0
    second = json.loads((out / "nnscaler-search.json").read_text())["files"]
    names = {p.name for p in out.iterdir()}
    assert names == set(second) | {"nnscaler-search.json", "notes.txt"}, (first, names)
    assert (out / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    (other / "plan_0.json").write_text("{}")
    assert search(model_dir, other) == 2
    assert "already holds plan_0.json" in capsys.readouterr().err
    assert (other / "plan_0.json").read_text() == "{}"


def test_search_takes_a_precision_and_a_length_histogram(model_dir, tmp_path, capsys):
    assert search(model_dir, tmp_path / "p", n=8, extra=("--precision", "fp32", "--lengths", "32:3,64:1")) == 0
    capsys.readouterr()
    plan = json.loads((tmp_path / "p" / "plan_0.json").read_text())
    assert plan["precision"] == "fp32"
    assert sorted(map(int, plan["estimate"]["details"]["lengths"])) == [32, 64]
    assert cli(["search", "--model", model_dir, "-n", "8", "--lengths", "long", "--no-progress"]) != 0
    assert "--lengths 'long'" in capsys.readouterr().err
