"""`latest(root)`: the newest complete checkpoint under a folder, what a job reloads when it
starts again after a fault.

    root = "ckpt"
    path = nns.checkpoint.latest(root)
    extra = nns.checkpoint.load(path, module, optimizer) if path else {}
    step = extra.get("step", 0)
    ...
    nns.checkpoint.save(f"{root}/step-{step:08d}", module, optimizer, background=True, step=step)

A save never shows an unfinished checkpoint under its final name (atomic.py): a killed save leaves
only a hidden `.NAME.saving-*` sibling, which is skipped here. A directory counts as complete when
its metadata is readable and every file it lists is there with the size it records (the SHA-256
is checked by `load`, for the files each rank reads). The newest is the one saved last by the
time rank 0 recorded when publishing it (the directory's metadata time for older checkpoints);
names break ties.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

from nnscaler_plugins.checkpoint.atomic import METADATA, sibling
from nnscaler_plugins.checkpoint.background import wait_for_saves
from nnscaler_plugins.checkpoint.format import FORMAT


def is_complete(directory: str) -> bool:
    """Whether `directory` holds a whole checkpoint `nns.checkpoint.save` published (sizes checked)."""
    meta_path = os.path.join(directory, METADATA)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"),
                                                                                                   dict):
        return False
    for name, want in meta["files"].items():
        try:
            if os.path.getsize(os.path.join(directory, name)) != want["bytes"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
    return True


def _saved_at(directory: str) -> float:
    meta_path = os.path.join(directory, METADATA)
    try:
        with open(meta_path) as f:
            t = json.load(f).get("saved_at")
        if isinstance(t, (int, float)):
            return float(t)
    except (OSError, ValueError, AttributeError):
        pass
    return os.path.getmtime(meta_path)


def latest(root: str | os.PathLike) -> Optional[str]:
    """The newest complete checkpoint directory directly under `root` (or `root` itself when it is
    one and holds none), or None when there is none (no folder yet, or only unfinished saves).

    Checkpoints written with a fallback swap that crashed between its two renames (atomic.py) are
    found under their kept name. A background save this process has in flight is waited for first.
    Reads metadata only: cheap enough to call on every rank."""
    wait_for_saves()
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("."):
            continue  # unfinished saves and kept previous checkpoints (below)
        if os.path.isdir(path) and is_complete(path):
            found.append(path)
    # a final name missing with its previous checkpoint kept beside it (a crash inside a fallback swap)
    for kept in glob.glob(os.path.join(glob.escape(root), ".*.previous-*")):
        name = os.path.basename(kept)[1:].rsplit(".previous-", 1)[0]
        if not os.path.exists(os.path.join(root, name)) and kept.startswith(sibling(os.path.join(root, name),
                                                                                    "previous", "")) \
                and is_complete(kept):
            found.append(kept)
    if not found:
        return root if is_complete(root) else None
    return max(found, key=lambda p: (_saved_at(p), os.path.basename(p)))
