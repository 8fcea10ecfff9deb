"""Real multi-process workers for tests: N processes over gloo on 127.0.0.1, started once per module.

    workers = Workers(4)
    results = workers.run(fn, *args)   # fn(rank, world_size, *args) on every rank, results in rank order
    workers.close()

`fn` must be a module-level function (pickled by reference); the children get the parent's
sys.path, so functions in test modules import there too. A worker's exception is raised here with
its traceback. If some ranks fail while others are stuck in a collective waiting for them, or a task
outlives its timeout, the workers are killed and the next `run` starts fresh ones.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import tempfile
import sys
import time
import traceback
from typing import Any, Callable

# Seconds the other ranks get to finish after one rank failed, before they are presumed stuck.
FAILURE_GRACE_S = 10.0


class WorkerError(RuntimeError):
    """A task failed on a worker; the message carries the worker's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel kill this worker when the test process dies, however it dies: a
    killed pytest (SIGTERM, SIGKILL) runs no exit handler, and its workers would otherwise wait on
    their queues and sockets, spinning, for good."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _worker(rank: int, world: int, port: int, path: list[str], tasks: Any, results: Any, parent: int) -> None:
    _die_with_parent(parent)
    # Set before torch is imported here, so its thread pools start small.
    os.environ["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path[:0] = [p for p in path if p not in sys.path]
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _stack_dump_on_signal(rank, port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30))
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            out = (True, pickle.dumps(fn(rank, world, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test process
            text = traceback.format_exc()
            try:
                original = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                original = None
            out = (False, pickle.dumps((text, original)))
        results.put((rank,) + out)
    # Every result has been received by the parent before it sends None. Tearing the gloo group
    # down (destroy_process_group) waits on its peers and takes seconds per module on 2 cores;
    # the process is ending anyway, so leave at once.
    os._exit(0)


def _stack_file(rank: int, port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"nns_worker_{port}_{rank}.stacks")


def _stack_dump_on_signal(rank: int, port: int) -> None:
    """SIGUSR1 writes every thread's Python stack to a file the parent reads: when some ranks
    failed and others stay silent, the error says where the silent ones are."""
    import faulthandler

    out = open(_stack_file(rank, port), "w")  # kept open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)


class Workers:
    def __init__(self, world_size: int, timeout: float = 300.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = self._port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, port, list(sys.path), self._tasks[r], self._results,
                                         os.getpid()))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """fn(rank, world_size, *args, **kwargs) on every rank; the results in rank order."""
        if not self._procs:
            self._start()
        task = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(task)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        done: dict[int, tuple[bool, bytes]] = {}
        failed_at = None
        while len(done) < self.world_size:
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S):
                break
            try:
                rank, ok, payload = self._results.get(timeout=0.5)
                done[rank] = (ok, payload)
                if not ok and failed_at is None:
                    failed_at = time.monotonic()
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
                if dead:
                    codes = [self._procs[r].exitcode for r in dead]
                    self._kill()
                    raise WorkerError(f"{getattr(fn, '__name__', fn)}: worker rank(s) {dead} died "
                                      f"(exit codes {codes})")
        stacks = ""
        if len(done) < self.world_size:
            stacks = self._stacks(sorted(set(range(self.world_size)) - set(done)))
            self._kill()
        for rank in sorted(done):
            ok, payload = done[rank]
            if not ok:
                text, original = pickle.loads(payload)
                cause = _loads_or_none(original)
                raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on rank {rank}:\n{text}{stacks}") from cause
        if len(done) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(done))
            raise WorkerError(f"{getattr(fn, '__name__', fn)}: rank(s) {missing} did not finish within "
                              f"{self.timeout if timeout is None else timeout:.0f} s; workers killed{stacks}")
        return [pickle.loads(done[r][1]) for r in range(self.world_size)]

    def _stacks(self, ranks: list[int]) -> str:
        """Where the silent ranks are: each one's Python stacks (SIGUSR1 makes it write them)."""
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for r in ranks:
            try:
                with open(_stack_file(r, self._port)) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            parts.append(f"\n--- rank {r} (no result) was at:\n{text or '(no stack written)'}")
        return "".join(parts)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for r in range(len(self._procs)):
            try:
                os.remove(_stack_file(r, self._port))
            except OSError:
                pass
        self._procs = []

    def close(self) -> None:
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self._kill()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _loads_or_none(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001
        return None
