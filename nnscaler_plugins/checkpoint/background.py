"""Saves written by a thread while training goes on: the handle `save(..., background=True)` returns.

One save is in flight per process at a time: a later save or load first waits for it, so two
saves never interleave their meetings of the ranks (which are numbered per process), and a load
right after a save reads what was saved. The thread is not a daemon: a process that ends while a
save is being written finishes the write first. A save that failed in the background raises its
error from `wait()`; nobody waited for it, a later save or load raises it instead, so a failure is
never silent.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from nnscaler_plugins.checkpoint.errors import CheckpointError

log = logging.getLogger("nnscaler_plugins.checkpoint")

_lock = threading.Lock()
_in_flight: list["SaveHandle"] = []  # at most one, not yet waited for


class SaveHandle:
    """A checkpoint being written in the background. `wait()` returns its directory once it is
    complete and in place (or raises `CheckpointError`); `done()` says whether the write ended."""

    def __init__(self, path: str, run: Callable[[], str]):
        self.path = path
        self._run = run
        self._result: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._reported = False
        self._thread = threading.Thread(target=self._body, name=f"nnscaler-save {path}", daemon=False)

    def _body(self) -> None:
        try:
            self._result = self._run()
        except BaseException as e:  # noqa: BLE001 - kept for wait()
            self._error = e
            log.error("background checkpoint save to %s failed: %s", self.path, e)
        finally:
            self._run = None  # type: ignore[assignment]  # the job's host copies go with it

    def done(self) -> bool:
        """Whether the write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until the checkpoint is complete; its directory. Raises what the write raised, or
        TimeoutError when `timeout` seconds pass first (the write goes on)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save to {self.path} is still being written after {timeout} s")
        with _lock:
            if self in _in_flight:
                _in_flight.remove(self)
        self._reported = True
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"the background save to {self.path} failed: {self._error}") from self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error is not None else "complete")
        return f"SaveHandle({self.path!r}, {state})"


def start_in_background(run: Callable[[], str], path: str) -> SaveHandle:
    handle = SaveHandle(path, run)
    with _lock:
        _in_flight.append(handle)
    handle._thread.start()
    return handle


def wait_for_saves() -> None:
    """Wait for the save in flight, if any (raises its error if nobody has seen it yet)."""
    with _lock:
        pending = list(_in_flight)
    for handle in pending:
        handle.wait()
