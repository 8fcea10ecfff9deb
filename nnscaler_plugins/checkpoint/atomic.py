"""Writing a checkpoint directory so that no crash ever leaves the previous one unreadable.

A save writes into a temporary sibling directory (same parent, so the final move is a rename on
one file system), fsyncs every file and the directory, and only then swaps it into place. On Linux
the swap is one `renameat2(RENAME_EXCHANGE)`: the old and new directories trade names in a single
atomic step, so at every instant the final path names a complete checkpoint. Where that call does
not exist, the old directory is first renamed to a `.previous-*` sibling and the new one renamed
into place; a crash between the two renames leaves the final path missing but the previous
checkpoint whole under the sibling name, and `resolve_checkpoint_dir` finds it there.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import shutil

METADATA = "metadata.json"
_SAVING = "saving"
_PREVIOUS = "previous"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def sibling(final: str, kind: str, token: str) -> str:
    """A hidden sibling of `final`: `.NAME.KIND-TOKEN` in the same parent directory."""
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}.{kind}-{token}")


def temp_dir(final: str, token: str) -> str:
    return sibling(final, _SAVING, token)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Makes the directory's entries (new files, renames) durable, not only the files' bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms without directory handles (Windows) have no directory fsync
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths' names; False where the platform cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    return False  # e.g. EINVAL on file systems without exchange: fall back to two renames


def swap_into_place(tmp: str, final: str, token: str) -> None:
    """Make the complete directory `tmp` the checkpoint at `final`; the old one is deleted only
    after the new one is in place."""
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final) and not os.path.isdir(final):
        raise FileExistsError(f"{final} exists and is not a checkpoint directory; choose another path")
    if not os.path.exists(final):
        os.rename(tmp, final)
        fsync_dir(parent)
        return
    if _exchange(tmp, final):
        fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous checkpoint
        return
    previous = sibling(final, _PREVIOUS, token)
    os.rename(final, previous)
    os.rename(tmp, final)
    fsync_dir(parent)
    shutil.rmtree(previous, ignore_errors=True)


def remove_stale(final: str) -> None:
    """Once a complete checkpoint is at `final`: delete what killed saves left beside it (half-written
    directories, and previous checkpoints a fallback swap had set aside)."""
    parent, name = os.path.split(os.path.abspath(final))
    for kind in (_SAVING, _PREVIOUS):
        for path in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.{kind}-*")):
            shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint_dir(path: str) -> str:
    """The checkpoint directory meant by `path`: the directory itself, the directory of a file
    inside it (users often pass the metadata or a shard file), or, after a crash between the
    fallback swap's two renames, the previous checkpoint kept under its sibling name."""
    path = os.path.abspath(path)
    if os.path.isfile(path) and os.path.exists(os.path.join(os.path.dirname(path), METADATA)):
        return os.path.dirname(path)
    if os.path.isdir(path) or os.path.exists(path):
        return path
    kept = sorted(glob.glob(glob.escape(sibling(path, _PREVIOUS, "")) + "*"), key=os.path.getmtime)
    complete = [k for k in kept if os.path.exists(os.path.join(k, METADATA))]
    return complete[-1] if complete else path
