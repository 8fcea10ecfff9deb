"""The generated-code cache never imports a damaged file: each file carries the SHA-256 of its
text, and one cut short (a full disk, a process killed while writing) or edited is named in a
warning and generated again."""
from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

import models


def _compile(cache: str):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.mlp()
    return nns.compile(model, batch, "tp", world_size=2, cache_dir=cache), model, batch


def _forget_imported() -> None:
    """Drop the generated modules this process imported, so the next compile imports from disk."""
    for name in [n for n in sys.modules if n.startswith("nnscaler_gen_")]:
        del sys.modules[name]


@pytest.mark.parametrize("damage", ["cut short", "edited", "seal removed"])
def test_a_damaged_cache_file_is_detected_and_generated_again(tmp_path, damage):
    cache = str(tmp_path / "cache")
    compiled, _, _ = _compile(cache)
    whole = compiled.artifact(0).source()
    path = glob.glob(os.path.join(cache, "*", "rank0.py"))[0]
    with open(path) as f:
        text = f.read()
    if damage == "cut short":
        text = text[: len(text) // 2]
    elif damage == "edited":
        text = text.replace("def forward(", "def forward_(", 1)
    else:
        text = text[: text.rstrip("\n").rfind("\n") + 1]
    with open(path, "w") as f:
        f.write(text)
    _forget_imported()
    again, _, _ = _compile(cache)
    with pytest.warns(UserWarning, match=r"rank0.py is damaged"):
        artifact = again.artifact(0)  # where the file is read
    assert artifact.source() == whole
    assert callable(artifact.module.forward)


def test_an_intact_cache_file_is_reused_without_a_word(tmp_path, recwarn):
    cache = str(tmp_path / "cache")
    _compile(cache)[0].artifact(0)
    path = glob.glob(os.path.join(cache, "*", "rank0.py"))[0]
    stamp = os.stat(path).st_mtime_ns
    _forget_imported()
    _compile(cache)[0].artifact(0)
    assert os.stat(path).st_mtime_ns == stamp
    assert not [w for w in recwarn if "damaged" in str(w.message)]
