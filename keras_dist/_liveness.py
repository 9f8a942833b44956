"""Heartbeats from launched workers, and the launcher's view of them.

A process started by `keras-dist launch` / `keras-dist tune` gets the path
of a heartbeat file in `KERAS_DIST_HEARTBEAT`. On `import keras_dist` a
daemon thread rewrites that file every second (no network listener): when
the process last beat, whether it joined its cluster, how many steps it has
run and when the last one ended. keras_dist's train / test / predict
functions count the steps.

The launcher reads the files (and `/proc` where there is one) to tell apart:
- a worker that never joins its cluster (`start_timeout`),
- a worker that makes no step for `hang_timeout` seconds while it should
  (it joined its cluster, or it is inside a tuner trial),
- a worker whose process stopped responding: stopped by a signal, or silent
  (no heartbeat) while using no CPU, for `unresponsive_after` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass

ENV = "KERAS_DIST_HEARTBEAT"
# The launcher's pid: only its own children beat (a process the worker
# spawns, e.g. a multiprocessing data worker that imports keras_dist again,
# inherits the environment but must not overwrite the worker's file).
PARENT_ENV = "KERAS_DIST_LAUNCHER_PID"
INTERVAL = 1.0
# The launcher's folder of heartbeat files (`tempfile.mkdtemp(prefix=...)`).
FOLDER_PREFIX = "keras_dist_heartbeat_"
# How long a silent process (no heartbeat, no CPU use) and a stopped one
# (state T in /proc: it cannot be busy) are given before they are reported.
# TensorFlow's coordination service makes the peers fail about 10 s after a
# worker stops; the launcher then names the stopped worker as the cause.
UNRESPONSIVE_AFTER = 15.0
STOPPED_AFTER = 5.0
# A file the launcher writes in its heartbeat folder when a worker failed:
# the others then abort their collectives (`_peer_lost`); looked for
# `_LOOKS_PER_BEAT` times per heartbeat, as is the launcher (a worker whose
# launcher is gone stops within a tenth of a heartbeat).
PEER_LOST = "peer-lost"
_LOOKS_PER_BEAT = 10

_path = os.environ.get(ENV)
_state = {
    "joining": False, "joined": False, "active": True, "steps": 0, "progress": time.time(),
    "in_step": False, "peer_lost": False,
}
_MAIN = threading.main_thread().ident
_thread: threading.Thread | None = None


# A wait longer than this (a worker for its peers, once it started joining;
# a quarter of --start-timeout if that is shorter) is said once on the console.
WAIT_NOTICE_AFTER = 10.0

# -- in the worker -------------------------------------------------------------


def start() -> None:
    """Starts the heartbeat thread once, in a launched process."""
    global _path, _thread
    if not _path or _thread is not None:
        return
    parent = os.environ.get(PARENT_ENV)
    if parent and parent != str(os.getppid()):
        _path = None  # a grandchild: no heartbeat, no step counting
        return
    _thread = threading.Thread(target=_beat, name="keras-dist-heartbeat", daemon=True)
    _thread.start()


def _beat() -> None:
    # Ends when the file cannot be written: the launcher removed its
    # directory, so nobody reads it any more.
    launcher = os.getppid()
    lost = os.path.join(os.path.dirname(_path), PEER_LOST)
    while True:
        if os.getppid() != launcher:
            _orphaned(launcher)
        if not _write():
            if os.getppid() != launcher:  # another orphan removed the folder
                _orphaned(launcher)
            return
        for _ in range(_LOOKS_PER_BEAT):
            time.sleep(INTERVAL / _LOOKS_PER_BEAT)
            if os.getppid() != launcher:  # gone: stop within a look, not a beat
                _orphaned(launcher)
            if not _state["peer_lost"] and os.path.exists(lost):
                _peer_lost(lost)


def _peer_lost(marker: str) -> None:
    """The launcher says a worker of this group failed: no collective can
    complete any more. The ones this process waits in (a step, a backup's
    agreement) are made to fail now, so it ends through its own error path
    (its `finally` blocks, a backup write in flight finished) instead of
    waiting to be killed at the end of the grace period."""
    _state["peer_lost"] = True
    if not _state["joined"]:
        return  # no cluster yet: nothing waits in a collective
    try:
        with open(marker, encoding="utf-8") as f:
            reason = f.read().strip()
    except OSError:
        reason = "a worker of this job stopped"
    from keras_dist import _keras_compat

    _keras_compat.abort_collectives(
        f"{reason}; this worker's collectives were aborted by the launcher")


def peer_lost() -> bool:
    """Whether the launcher said a worker of this group failed."""
    return _state["peer_lost"]


def _orphaned(launcher: int) -> None:
    """The launcher is gone (SIGKILL, the OOM killer, a lost login shell):
    nobody supervises this worker any more, and a re-run of the job would
    find it still training and writing its backups. Removes the launcher's
    heartbeat folder (nobody reads it now; a worker that finds it gone
    checks its own launcher) and ends the process at once, as the launcher
    would have stopped it; the job resumes from its last backup when it is
    run again."""
    with contextlib.suppress(OSError, ValueError):  # to the launcher's pipe, likely closed
        sys.stderr.write(
            f"[keras-dist] the launcher (pid {launcher}) is gone: this worker "
            f"(pid {os.getpid()}) stops with it\n"
        )
        sys.stderr.flush()
    with _write_lock:
        folder = os.path.dirname(_path)
        if os.path.basename(folder).startswith(FOLDER_PREFIX):  # the launcher's own
            shutil.rmtree(folder, ignore_errors=True)
        else:  # a folder the launcher did not make: only this worker's files
            for path in (f"{_path}.tmp", _path):
                with contextlib.suppress(OSError):
                    os.remove(path)
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


_write_lock = threading.Lock()


def _where() -> str:
    """Where the main thread is: its innermost frame in the user's code."""
    frame = sys._current_frames().get(_MAIN)
    innermost = None
    while frame is not None:
        name = frame.f_code.co_filename
        here = f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
        innermost = innermost or here
        if not any(part in name for part in _LIBRARY_PATHS):
            return here
        frame = frame.f_back
    return innermost or "unknown"


_LIBRARY_PATHS = (
    os.sep + "site-packages" + os.sep,
    os.sep + "dist-packages" + os.sep,
    os.path.dirname(os.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    "<frozen ",
)


def _write() -> bool:
    """Writes the heartbeat file; False when that is no longer possible."""
    payload = dict(_state, pid=os.getpid(), time=time.time(), where=_where())
    with _write_lock:
        tmp = f"{_path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(payload, f)
            os.replace(tmp, _path)
        except OSError:
            return False
    return True


def note_saved(backup_dir: str, epoch: int, step: int) -> None:
    """A backup was saved before the process exits on a preemption signal:
    written at once, so the launcher can say where the job resumes."""
    if _path:
        _state["saved"] = {"backup_dir": os.path.abspath(backup_dir), "epoch": epoch,
                           "step": step}
        _write()


def step_begins() -> None:
    """A train / test / predict call starts (it may wait in a collective)."""
    if _path:
        _state["in_step"] = True


def step() -> None:
    """One train / test / predict call finished (cheap: no I/O)."""
    if _path:
        _state["in_step"] = False
        _state["steps"] += 1
        _state["progress"] = time.time()


def counted(run_step, *args):
    """`run_step(*args)`: one train / test / predict call of a keras_dist
    model, counted for the launcher's hang detection (it may wait in a
    collective for the other workers)."""
    step_begins()
    try:
        return run_step(*args)
    finally:
        step()


@contextlib.contextmanager
def in_collective():
    """A keras_dist collective outside a step (a callback's agreement): it
    may wait for the other workers, as a step does."""
    before = _state["in_step"]
    if _path:
        _state["in_step"] = True
    try:
        yield
    finally:
        if _path:
            _state["in_step"] = before


def joining() -> None:
    """The process is creating its multi-worker strategy (waits for peers)."""
    if _path:
        _state["joining"] = True
        # Now: TensorFlow may hold Python's lock while it waits for the
        # other workers, which would keep the thread from writing.
        _write()


def joined() -> None:
    """The process's multi-worker cluster formed."""
    if _path:
        _state["joined"] = True
        _state["progress"] = time.time()
        _write()


def set_active(active: bool) -> None:
    """Whether a long wait without steps is expected now (False: e.g. a tuner
    worker waiting for its next trial)."""
    if _path:
        _state["active"] = active
        _state["trial"] = active
        _state["progress"] = time.time()


# -- in the launcher -----------------------------------------------------------


@dataclass
class Timeouts:
    """The launcher's limits, in seconds (None: not checked)."""

    start: float | None = 300.0
    hang: float | None = 900.0
    unresponsive: float = UNRESPONSIVE_AFTER

    @classmethod
    def checked(cls, start_timeout, hang_timeout) -> "Timeouts":
        """The launchers' `start_timeout` / `hang_timeout` arguments, checked."""
        from keras_dist._checks import check_timeout

        check_timeout("start_timeout", start_timeout)
        check_timeout("hang_timeout", hang_timeout)
        return cls(start=start_timeout, hang=hang_timeout)


def read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> tuple[str | None, float | None]:
    """(state letter, CPU seconds) from /proc, or (None, None) without it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # Fields after the command: state, ..., utime (12th), stime (13th).
    return fields[0], (int(fields[11]) + int(fields[12])) / ticks


def is_stopped(pid: int) -> tuple[bool, str | None]:
    """(whether the process is stopped by a signal or a debugger, its state)."""
    state, _ = process_state(pid)
    return state in ("T", "t"), state


class Watch:
    """The launcher's record of one process: call `check` about every second."""

    def __init__(self, pid: int, heartbeat: str, multi_worker: bool, timeouts: Timeouts):
        self.pid = pid
        self.heartbeat = heartbeat
        self.multi_worker = multi_worker
        self.timeouts = timeouts
        self.started = time.time()
        self.quiet_since: float | None = None  # stopped, or silent with no CPU use
        self.quiet_cpu: float | None = None
        self.last: dict | None = None
        self.joining_since: float | None = None  # first seen joining

    def waiting(self) -> float | None:
        """Seconds a worker of a multi-worker group has waited for the other
        workers to join its cluster (since its heartbeat first said it was
        joining), if it waits now."""
        if not self.multi_worker or self._joined() or not (self.last or {}).get("joining"):
            self.joining_since = None
            return None
        if self.joining_since is None:
            self.joining_since = time.time()
        return time.time() - self.joining_since

    def check(self) -> tuple[int, str] | None:
        """(how likely the cause, lowest first; what is wrong), or None.

        A stopped or silent process is the likeliest cause, then one that
        never started joining its cluster, then one waiting for the others
        to join, then one without steps (the fewer steps, the likelier).
        One check per kind of problem, in that order.
        """
        now = time.time()
        beat = read(self.heartbeat)
        if beat is not None:
            self.last = beat
        state, cpu = process_state(self.pid)
        if state is None and beat is None:
            return None
        return (
            self._unresponsive(now, beat, state, cpu)
            or self._not_joined(now)
            or self._no_progress(now)
        )

    def _unresponsive(self, now, beat, state, cpu) -> tuple[int, str] | None:
        """Stopped (state T), or silent with no CPU use, for too long."""
        stopped = state in ("T", "t")  # as is_stopped
        silent = beat is not None and now - beat["time"] > 3 * INTERVAL
        if not (stopped or silent):
            self.quiet_since = None
            return None
        if self.quiet_since is None or (
            not stopped and cpu is not None and cpu != self.quiet_cpu
        ):
            # Quiet from now on; a silent process that uses CPU is busy (a
            # long call holding Python's lock), not stuck: its window restarts.
            self.quiet_since, self.quiet_cpu = now, cpu
            return None
        limit = self.timeouts.unresponsive
        if stopped:
            limit = min(STOPPED_AFTER, limit)
        if now - self.quiet_since < limit:
            return None
        if stopped:
            return 0, (
                "stopped responding: its process has been stopped "
                f"(state {state}: SIGSTOP, or a debugger) for "
                f"{now - self.quiet_since:.0f}s"
            )
        return 0, (
            "stopped responding: no heartbeat"
            + (" and no CPU use" if cpu is not None else "")
            + f" for {now - self.quiet_since:.0f}s (process state {state or 'unknown'})"
        )

    def _joined(self) -> bool:
        last = self.last or {}
        return bool(last.get("joined")) or last.get("steps", 0) > 0

    def _not_joined(self, now) -> tuple[int, str] | None:
        """A worker of a multi-worker group that did not join in time."""
        limit = self.timeouts.start
        if not (self.multi_worker and limit) or self._joined():
            return None
        if now - self.started <= limit:
            return None
        if (self.last or {}).get("joining"):
            return 2, (
                f"never joined the cluster within {limit:g}s (it waited "
                "for the other workers to join)"
            )
        doing = (
            "keras_dist was imported, but no multi-worker strategy was "
            "created" if self.last is not None
            else "it never even imported keras_dist"
        )
        return 1, f"never joined the cluster within {limit:g}s ({doing})"

    def stalled_outside_a_step(self) -> tuple[int, str] | None:
        """Its report if it made no step for half the hang limit and is
        outside any step or keras_dist collective: while a peer hangs inside
        one, waiting for the others, this process is the likelier cause."""
        last = self.last or {}
        if last.get("in_step") or not self.timeouts.hang:
            return None
        found = self._no_progress(time.time(), self.timeouts.hang / 2)
        if found is None:
            return None
        return found[0], found[1] + ", outside any step while the others wait for it"

    def _no_progress(self, now, threshold=None) -> tuple[int, str] | None:
        """A process that makes steps (or runs a trial) and stopped making
        them for `threshold` seconds (default: the hang limit)."""
        limit, last = self.timeouts.hang, self.last
        if not limit or last is None or not last.get("active", True):
            return None
        started = (
            self._joined()
            or last.get("trial")
            or (not self.multi_worker and last.get("steps", 0) > 0)
        )
        idle = now - float(last.get("progress", now))
        if not started or idle <= (threshold or limit):
            return None
        steps = last.get("steps", 0)
        rank = 4 if last.get("in_step") else 3
        where = (
            "inside a step (a collective waits for its peers?)"
            if last.get("in_step") else f"at {last.get('where', 'unknown')}"
        )
        return rank + steps / 1e9, (
            f"made no step for {idle:.0f}s (limit {limit:g}s), {where}; "
            + (f"{steps} step(s) before that" if steps else "no step since it joined the cluster")
        )

    def summary(self) -> str:
        last = self.last
        if last is None:
            return "no heartbeat yet (keras_dist not imported)"
        if not last.get("joined") and self.multi_worker:
            if last.get("joining"):
                return "waiting for the other workers to join"
            return "has not started joining"
        where = "inside a step" if last.get("in_step") else f"at {last.get('where', '?')}"
        return (
            f"{last.get('steps', 0)} step(s), last progress "
            f"{time.time() - float(last.get('progress', time.time())):.0f}s ago, {where}"
        )
