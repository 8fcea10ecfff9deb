"""The watchdog: a rank that waits in a collective for a rank that never comes says who and where.

One thread per process watches the flight recorder of the ParallelModule that ran last
(runtime/flight_recorder.py). It never communicates through a collective (a hung collective blocks
those): every `heartbeat_s` it publishes this rank's position under its own key of the default
process group's store, and reads the others' when it reports.

When the recorder has not moved for the plan's `collective_timeout_s` and this rank is waiting
(its main thread is blocked in a torch.distributed call or a `.wait()`, or, on a GPU, the stream
still has work it cannot finish), the watchdog reports, then ends the process with exit code
`HANG_EXIT_CODE` so the launcher (torchrun's elastic agent) restarts the job from its last
checkpoint. The report names the collective waited in (what it does, over which ranks, the op
and model source line it serves), the ranks of that collective that did not reach it, and every
rank's last position in its program (step, phase, stage, micro-batch, the last collective
completed, the op its main thread is in); it goes to stderr and, as JSON, to
`<report_dir>/hang-step<N>-rank<R>.json`.

A rank that is not waiting but has not moved either (a straggler, a rank stuck in its own code)
does not end itself: it prints one line, and the waiting ranks name it. Ending it first would let
the launcher stop the waiting ranks before they report.

Without a timeout set, the watchdog waits as long as the backend would (`default_timeout_s`):
torch's default process-group timeout for it (10 minutes for NCCL, 30 for gloo), less a tenth,
so the report comes before the backend's own error.
"""
from __future__ import annotations

import atexit
import datetime
import json
import linecache
import logging
import os
import re
import sys
import threading
import time
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.runtime.flight_recorder import FlightRecorder, is_generated_file
from nnscaler_plugins.runtime.job_store import job_store, key

log = logging.getLogger("nnscaler_plugins.runtime")

#: The exit code of a process the watchdog ended (EX_TEMPFAIL: try again; the launcher restarts).
HANG_EXIT_CODE = 75
_WAIT_LINE = re.compile(r"\.wait\(|\bdist\.|batch_isend_irecv|all_reduce|all_gather|reduce_scatter|broadcast|"
                        r"all_to_all|\bbarrier\(|\.recv\(")


def default_timeout_s(backend: Optional[str] = None) -> float:
    """How long a collective may wait before the watchdog reports, when the plan does not say: the
    backend's default process-group timeout less a tenth."""
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    base = nccl if backend == "nccl" and nccl is not None else constants.default_pg_timeout
    return 0.9 * base.total_seconds()


# -- the main thread, seen from the watchdog -------------------------------------------------------------------
def _main_frame() -> Any:
    return sys._current_frames().get(threading.main_thread().ident)


def in_communication(frame: Any) -> bool:
    """Whether the innermost frame waits for other ranks: inside torch.distributed, or on a line
    that waits for a collective or point-to-point transfer."""
    if frame is None:
        return False
    name = frame.f_code.co_filename.replace("\\", "/")
    if "/torch/distributed/" in name:
        return True
    return bool(_WAIT_LINE.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno)))


def generated_position(frame: Any, recorder: FlightRecorder) -> Optional[dict[str, Any]]:
    """The op of the generated program the main thread is in (its innermost generated frame)."""
    while frame is not None and not is_generated_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    m = re.match(r"([A-Za-z_][\w, ]*?)\s*=", line)
    names = [n.strip() for n in m.group(1).split(",")] if m else []
    fn = frame.f_code.co_name  # forward, forward_loss, stage{k}, stage{k}_loss
    stage = int(re.match(r"stage(\d+)", fn).group(1)) if re.match(r"stage(\d+)", fn) else None
    stages = recorder.program.ranks[recorder.unit_device].stages
    order = [stage] if stage in stages else list(stages)
    gather = _parameter_gather(line, stages[order[0]] if order else None, recorder)
    for uses in (False, True):  # the statement binding the line's name; else (a parameter fetched) its first use
        for s in order:
            for stmt in stages[s].stmts:
                op = stmt.op
                hit = any(n in (stmt.out or ()) for n in names) if not uses else \
                    op is not None and any(n in (op.inputs or ()) or n == stmt.src for n in names)
                if names and hit:
                    return {"stage": s, "line": line, "op": op.where() if op is not None else names[0],
                            "source": getattr(op, "source", None),
                            "source_code": getattr(op, "source_code", None) or None, "gather": gather}
    return {"stage": stage, "line": line, "op": None, "source": None, "source_code": None, "gather": gather}


def _parameter_gather(line: str, stage: Any, recorder: FlightRecorder) -> Optional[dict[str, Any]]:
    """A line binding a parameter (`x = _P[i]`) under ZeRO-3 gathers it from the data-parallel
    replicas first: which parameter, over which ranks."""
    m = re.search(r"=\s*_P\[(\d+)\]", line)
    plan = recorder.program.plan
    if m is None or stage is None or not (plan.zero >= 3 and plan.dp > 1):
        return None
    i = int(m.group(1))
    if i >= len(stage.params):
        return None
    shard = recorder.program.shards[stage.params[i]]
    d = recorder.unit_device
    return {"collective": f"ZeRO-3 all-gather of parameter {shard.fqn}",
            "ranks": [r * plan.unit_size + d for r in range(plan.dp)]}


def _frame_where(frame: Any) -> Optional[str]:
    if frame is None:
        return None
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}: {text}"


# -- the thread ------------------------------------------------------------------------------------------------
class Watchdog:
    """The process's watchdog thread (`watch` starts it); see the module docstring."""

    def __init__(self) -> None:
        self._active: Optional[weakref.ref] = None
        self._lock = threading.Lock()
        self.timeout_s = default_timeout_s()
        self.report_dir = os.path.abspath("nnscaler_reports")
        self.device: Optional[torch.device] = None
        self._thread: Optional[threading.Thread] = None
        self._stalled_said = -1
        self._stop = threading.Event()

    def watch(self, recorder: FlightRecorder, timeout_s: float, report_dir: str, device: torch.device) -> None:
        """Watch `recorder` from now on (the module that ran last is the one watched)."""
        with self._lock:
            self._active = weakref.ref(recorder)
            self.timeout_s, self.report_dir, self.device = float(timeout_s), os.path.abspath(report_dir), device
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="nnscaler-watchdog", daemon=True)
                self._thread.start()
                atexit.unregister(self.stop)  # once, however often the thread is started again
                atexit.register(self.stop)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread and wait for it (at interpreter exit, and when a framework's strategy tears
        down: the next step that needs watching starts it again). A daemon thread still inside a store
        call when the interpreter finalizes is torn down in C++ code, which aborts the process
        ("terminate called without an active exception") after the job's work is done. The thread also
        ends by itself once the module it watches is gone."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout_s)

    def recorder(self) -> Optional[FlightRecorder]:
        ref = self._active
        return ref() if ref is not None else None

    @property
    def heartbeat_s(self) -> float:
        return min(max(self.timeout_s / 4, 0.5), 10.0)

    def _loop(self) -> None:
        last_seq, still_since, published = -1, time.monotonic(), 0.0
        while True:
            if self._stop.wait(min(1.0, max(self.timeout_s / 10, 0.05))):
                return
            rec = self.recorder()
            if rec is None:
                with self._lock:  # nothing left to watch (the module is gone): the thread ends; `watch` starts anew
                    if self.recorder() is None:
                        self._thread = None
                        return
                continue
            if not (dist.is_available() and dist.is_initialized()):
                continue
            now = time.monotonic()
            if rec.seq != last_seq:
                last_seq, still_since = rec.seq, now
            still = now - still_since
            try:
                if now - published >= self.heartbeat_s:
                    self._publish(rec, still)
                    published = now
                if still >= self.timeout_s:
                    frame = _main_frame()
                    if self._waiting(frame):
                        self._report(rec, still, frame)  # ends the process
                    elif rec.in_step and self._stalled_said != rec.seq:
                        self._stalled_said = rec.seq
                        where = generated_position(frame, rec) or {}
                        print(f"nnscaler watchdog: rank {dist.get_rank()} has made no progress for {still:.1f} s in "
                              f"step {rec.step} ({rec.phase}, stage {rec.stage}, micro-batch {rec.micro_batch}) and is "
                              f"not waiting for other ranks: {where.get('op') or _frame_where(frame)}", file=sys.stderr,
                              flush=True)
            except Exception as e:  # noqa: BLE001 - the watchdog must never take the job down by itself
                log.debug("watchdog: %s: %s", type(e).__name__, e)

    def _waiting(self, frame: Any) -> bool:
        if in_communication(frame):
            return True
        dev = self.device
        if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
            return not torch.cuda.current_stream(dev).query()  # device work that does not finish
        return False

    def _state(self, rec: FlightRecorder, still: float) -> dict[str, Any]:
        frame = _main_frame() if still >= self.heartbeat_s else None
        state = {"rank": dist.get_rank(), "time": time.time(), "no_progress_s": round(still, 3),
                 "position": rec.position(), "waiting": self._waiting(frame) if frame is not None else None}
        if frame is not None:
            state["in_op"] = generated_position(frame, rec)
            state["main_thread"] = _frame_where(frame)
        return state

    def _publish(self, rec: FlightRecorder, still: float) -> None:
        job_store().set(key("watchdog", dist.get_rank()), json.dumps(self._state(rec, still), default=str))

    def _peers(self) -> dict[int, Optional[dict]]:
        store = job_store()
        out: dict[int, Optional[dict]] = {}
        for r in range(dist.get_world_size()):
            k = key("watchdog", r)
            try:
                out[r] = json.loads(store.get(k)) if store.check([k]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out

    def _report(self, rec: FlightRecorder, still: float, frame: Any) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        me = self._state(rec, still)
        me["waiting"] = True
        try:
            self._publish(rec, still)
        except Exception:  # noqa: BLE001
            pass
        peers = self._peers()
        peers[rank] = me
        report = hang_report(rank, world, me, peers, self.timeout_s, self.heartbeat_s)
        path = os.path.join(self.report_dir, f"hang-step{rec.step}-rank{rank:05d}.json")
        try:
            os.makedirs(self.report_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1, default=str)
            written = f"the report is in {path}"
        except OSError as e:
            written = f"the report could not be written to {path} ({e})"
        print(report["message"] + f"\n  {written}; ending this process with exit code {HANG_EXIT_CODE} so the launcher "
              "restarts the job from its last checkpoint.", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)


def _op_words(d: Optional[dict]) -> str:
    if not d:
        return ""
    code = f" `{d['source_code']}`" if d.get("source_code") else ""
    return f"{d['op']}{code}" if d.get("op") else ""


def _position_words(state: Optional[dict], heartbeat_s: float) -> str:
    if state is None:
        return "no position published (the process never ran a step, or is gone)"
    pos = state.get("position", {})
    age = time.time() - float(state.get("time", 0))
    words = f"step {pos.get('step')}, {pos.get('phase')}, stage {pos.get('stage')}, micro-batch {pos.get('micro_batch')}"
    done = pos.get("last_completed")
    if done:
        words += f"; last completed: {done['collective']}" + (f" for {_op_words(done)}" if done.get("op") else "")
    reached = pos.get("backward_reached")
    if reached:
        words += f"; backward reached: {reached['collective']}" + (f" for {_op_words(reached)}" if reached.get("op")
                                                                   else "")
    in_op = state.get("in_op")
    if in_op and in_op.get("op"):
        words += f"; now in op {_op_words(in_op)}"
    elif state.get("main_thread"):
        words += f"; main thread at {state['main_thread']}"
    if state.get("waiting") is True:
        words += " (waiting for other ranks)"
    elif state.get("waiting") is False:
        words += " (not waiting for other ranks: computing or stuck in its own code)"
    if age > 3 * heartbeat_s:
        words += f" (last heard of {age:.0f} s ago: the process may be gone or frozen)"
    return words


def hang_report(rank: int, world: int, me: dict, peers: dict[int, Optional[dict]], timeout_s: float,
                heartbeat_s: float) -> dict[str, Any]:
    """The report of a rank that waited `timeout_s` in a collective (JSON-ready, with `message`)."""
    pos = me.get("position", {})

    def waited_in(state: dict) -> Optional[dict]:
        p = state.get("position", {})
        return p.get("waiting_in") or (state.get("in_op") or {}).get("gather") or p.get("backward_reached")

    collective = waited_in(me)
    in_op = me.get("in_op") or {}
    group = (collective or {}).get("ranks") or list(range(world))
    same = (pos.get("step"), (collective or {}).get("collective"))

    def arrived(r: int) -> bool:
        st = peers.get(r)
        if st is None or not st.get("waiting"):
            return False
        theirs = waited_in(st) or {}
        return (st.get("position", {}).get("step"), theirs.get("collective")) == same or collective is None

    missing = [r for r in group if r != rank and not arrived(r)]
    if collective is not None:
        what = f"{collective['collective']} over ranks {collective.get('ranks') or group}"
        serves = _op_words(collective) or _op_words(in_op)
    else:
        what = f"a collective outside the generated program ({me.get('main_thread')})"
        serves = _op_words(in_op)
    head = (f"nnscaler watchdog: rank {rank} waited {me.get('no_progress_s', 0):.1f} s (collective_timeout_s="
            f"{timeout_s:g}) in step {pos.get('step')}, {pos.get('phase')}, stage {pos.get('stage')}, micro-batch "
            f"{pos.get('micro_batch')}: in {what}" + (f", for op {serves}" if serves else "") + "."
            + (f"\n  Its main thread waits at {me['main_thread']}." if me.get("main_thread") and collective is not None
               else ""))
    if missing:
        head += f"\n  Missing: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not reach it."
    else:
        head += "\n  Every rank of it arrived as far as the published positions show; the backend itself may be stuck."
    lines = [head, "  Each rank's last position in its program:"]
    for r in range(world):
        lines.append(f"    rank {r}{' (this rank)' if r == rank else ''}: {_position_words(peers.get(r), heartbeat_s)}")
    return {"rank": rank, "world_size": world, "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "unix_time": time.time(),
            "timeout_s": timeout_s, "waited_s": me.get("no_progress_s"), "step": pos.get("step"),
            "collective": collective, "op": in_op or None, "missing_ranks": missing,
            "ranks": {str(r): peers.get(r) for r in range(world)}, "message": "\n".join(lines)}


#: The process's watchdog (one thread per process, started by the first ParallelModule that runs
#: on more than one process).
WATCHDOG = Watchdog()
