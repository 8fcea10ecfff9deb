"""The documentation site builds, and the code on its pages runs.

- `mkdocs build --strict` (mkdocs.yml at the repository root) passes: no broken link between pages,
  no page left out of the navigation, every API reference page collected from the docstrings.
- Every ```python block of docs/**/*.md and of README.md runs. A page's blocks run in order in one
  namespace (a later block may use what an earlier one made), in a fresh working directory, with
  `torch.manual_seed(0)` set before the first. On a page:
    `<!-- docs-test: skip (why) -->` right before a block skips that block; the reason is required
        (a block that needs several processes, a GPU, a framework's trainer or a model hub).
    `<!-- docs-test: setup tiny_lm tiny_model -->` anywhere on the page runs docs/snippets/tiny_lm.py
        then docs/snippets/tiny_model.py first, in one namespace: the page's `TinyLM`, `model`,
        `batch` and `graph` are the tiny model of the Getting started page (run once per test
        session; each page gets its own copy of the model).
  A line `--8<-- "path"` inside a block (pymdownx.snippets) is replaced by that file, as the site does.
- docs/images/layers.svg is what docs/images/layers.py draws from the import contract of
  tests/test_layers.py (`LAYERS`), so the picture in CONTRIBUTING.md and on the site stays true.
"""
from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\s`]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*docs-test:(?P<what>.*?)-->", re.DOTALL)
SKIP = re.compile(r"^\s*skip\s*\((?P<why>[^)]*\S[^)]*)\)\s*$")
SETUP = re.compile(r"^\s*setup((?:\s+[\w-]+)+)\s*$")
SNIPPET = re.compile(r"^[ \t]*--8<--[ \t]*\"(?P<path>[^\"]+)\"[ \t]*$", re.MULTILINE)


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    skip: Optional[str]  # the reason, when the page marks the block skipped


@dataclass
class Page:
    path: str
    blocks: list[Block]
    setups: list[str]


def doc_pages() -> list[str]:
    pages = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
    return [os.path.relpath(p, ROOT) for p in pages] + ["README.md"]


def read_page(rel: str, text: Optional[str] = None) -> Page:
    """The page's python blocks and markers; a malformed marker is an error naming its line."""
    text = open(os.path.join(ROOT, rel)).read() if text is None else text
    problems, setups = [], []
    pending_skip: Optional[str] = None
    last_end = 0
    events = sorted([(m.start(), "marker", m) for m in MARKER.finditer(text)]
                    + [(m.start(), "fence", m) for m in FENCE.finditer(text)], key=lambda e: e[0])
    blocks = []
    for start, kind, m in events:
        line = text.count("\n", 0, start) + 1
        if kind == "marker":
            if start < last_end:
                continue  # a marker written inside a code block is text
            what = m.group("what")
            if SKIP.match(what):
                pending_skip = SKIP.match(what).group("why").strip()
            elif SETUP.match(what):
                setups.extend(SETUP.match(what).group(1).split())
            else:
                problems.append(f"{rel}:{line}: docs-test marker {what.strip()!r} is neither "
                                "'skip (why)' (a reason is required) nor 'setup NAME'")
            continue
        if start < last_end:
            continue
        last_end = m.end()
        if m.group("lang") not in ("python", "py"):
            if pending_skip is not None:
                problems.append(f"{rel}:{line}: a docs-test skip marker stands before a {m.group('lang') or 'plain'} "
                                "block, which is never run; put it right before a python block")
                pending_skip = None
            continue
        body = SNIPPET.sub(lambda s: open(os.path.join(ROOT, s.group("path"))).read(), m.group("body"))
        indent = m.group("indent")
        if indent:
            body = "\n".join(x[len(indent):] if x.startswith(indent) else x for x in body.split("\n"))
        blocks.append(Block(rel, line, body, pending_skip))
        pending_skip = None
    if pending_skip is not None:
        problems.append(f"{rel}: a docs-test skip marker is followed by no python block")
    if problems:
        raise ValueError("\n".join(problems))
    return Page(rel, blocks, setups)


_SETUPS: dict[tuple[str, ...], dict] = {}


def setup_namespace(names: tuple[str, ...]) -> dict:
    """The names docs/snippets/NAME.py files define, run in order in one namespace, once per session;
    each call gets its own copies of the modules among them."""
    if names not in _SETUPS:
        ns: dict = {"__name__": "docs_setup"}
        for name in names:
            path = os.path.join(DOCS, "snippets", f"{name}.py")
            if not os.path.exists(path):
                raise FileNotFoundError(f"docs-test setup {name!r}: no file docs/snippets/{name}.py")
            exec(compile(open(path).read(), path, "exec"), ns)
        _SETUPS[names] = ns
    import torch

    return {k: copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v for k, v in _SETUPS[names].items()}


def run_page(page: Page, workdir: str) -> list[str]:
    """Runs the page's blocks; returns the skipped blocks' lines and reasons."""
    import torch

    import torch.distributed as dist

    ns: dict = {"__name__": "__docs__"}
    skipped = []
    here, environ, had_group = os.getcwd(), dict(os.environ), dist.is_initialized()
    os.chdir(workdir)
    try:
        if page.setups:
            ns.update(setup_namespace(tuple(page.setups)))
        torch.manual_seed(0)
        for block in page.blocks:
            if block.skip is not None:
                skipped.append(f"{block.page}:{block.line} ({block.skip})")
                continue
            where = f"{block.page}:{block.line}"
            # a real file, so tracebacks, warnings and generated code can quote the block's lines
            path = os.path.join(workdir, re.sub(r"\W", "_", where) + ".py")
            with open(path, "w") as f:
                f.write(block.code)
            try:
                exec(compile(block.code, path, "exec"), ns)
            except Exception as e:
                raise AssertionError(f"the python block at {where} failed: {type(e).__name__}: {e}") from e
    finally:
        os.chdir(here)
        # a page that started a one-process group (the DeepSpeed drop-in does) leaves none behind
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return skipped


PAGES = doc_pages()


@pytest.mark.parametrize("rel", PAGES)
def test_the_examples_on_the_page_run(rel, tmp_path):
    page = read_page(rel)
    if not page.blocks:
        return
    started = time.perf_counter()
    skipped = run_page(page, str(tmp_path))
    print(f"{rel}: {len(page.blocks) - len(skipped)} block(s) ran in {time.perf_counter() - started:.1f} s; "
          f"skipped: {skipped or 'none'}")


def test_most_examples_run():
    """Skipping is for what one CPU process cannot do; the pages' examples are mostly run."""
    blocks = [b for rel in PAGES for b in read_page(rel).blocks]
    skipped = [b for b in blocks if b.skip is not None]
    assert len(blocks) >= 40, f"only {len(blocks)} python blocks on the pages"
    assert len(skipped) <= len(blocks) // 3, (f"{len(skipped)} of {len(blocks)} blocks are skipped:\n"
                                              + "\n".join(f"{b.page}:{b.line} ({b.skip})" for b in skipped))


def test_a_failing_example_or_a_skip_without_reason_is_caught(tmp_path):
    """The checker itself: a block that raises fails with its page and line; a skip must say why."""
    bad = read_page("docs/x.md", "# x\n\nText.\n\n```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(AssertionError, match=r"docs/x.md:9 failed: AssertionError"):
        run_page(bad, str(tmp_path))
    with pytest.raises(ValueError, match="a reason is required"):
        read_page("docs/x.md", "<!-- docs-test: skip -->\n```python\nraise SystemExit\n```\n")
    ok = read_page("docs/x.md", "<!-- docs-test: skip (needs 4 processes) -->\n```python\nraise SystemExit\n```\n")
    assert run_page(ok, str(tmp_path)) == ["docs/x.md:2 (needs 4 processes)"]


# Not `--quiet`: mkdocs counts the warnings it logs, and --quiet stops them from being logged, so a
# strict build with --quiet passes whatever is broken (test_a_broken_link_fails_the_strict_build).
def mkdocs_available() -> bool:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not mkdocs_available(), reason="mkdocs and mkdocstrings are not installed (pip install -e '.[dev]')")
def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    for page in ("index.html", "getting-started/index.html", "api/passes/index.html", "troubleshooting/index.html"):
        assert os.path.exists(tmp_path / "site" / page), page
    api = open(tmp_path / "site" / "api" / "passes" / "index.html").read()
    assert "apply_tp" in api and "Megatron tensor parallelism" in api  # collected from the docstrings


@pytest.mark.skipif(not mkdocs_available(), reason="mkdocs and mkdocstrings are not installed (pip install -e '.[dev]')")
def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strict build is a check: with the site's own settings, a link to a page that does not exist
    fails it (the API pages are left out here, to keep this fast)."""
    import yaml

    config = yaml.safe_load(open(os.path.join(ROOT, "mkdocs.yml")))
    config["plugins"] = [p for p in config["plugins"] if p != "mkdocstrings" and "mkdocstrings" not in p]
    config["nav"] = [e for e in config["nav"] if "API reference" not in e]
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("api"))
    shutil.copytree(os.path.join(DOCS, "snippets"), tmp_path / "docs" / "snippets", dirs_exist_ok=True)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    links = [f for f in glob.glob(str(tmp_path / "docs" / "**" / "*.md"), recursive=True) if "/api" not in f]
    for f in links:  # pages that link into the API reference would fail for that alone
        text = open(f).read()
        open(f, "w").write(re.sub(r"\]\((?:\.\./)*api/[^)]*\)", "]", text))

    def build() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                               str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})

    ok = build()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    with open(tmp_path / "docs" / "troubleshooting.md", "a") as f:
        f.write("\nSee [nowhere](no-such-page.md).\n")
    broken = build()
    assert broken.returncode != 0 and "no-such-page.md" in broken.stdout + broken.stderr


def test_the_layers_picture_is_drawn_from_the_contract():
    sys.path.insert(0, os.path.join(DOCS, "images"))
    try:
        import layers as picture
    finally:
        sys.path.pop(0)
    drawn = picture.draw()
    on_disk = open(os.path.join(DOCS, "images", "layers.svg")).read()
    assert drawn == on_disk, "docs/images/layers.svg is stale: run `python docs/images/layers.py`"
    from test_layers import LAYERS

    for layer in LAYERS:
        for part in layer:
            assert (part or "nnscaler_plugins/__init__.py") in drawn or part in picture.BASE_NAMES, part
