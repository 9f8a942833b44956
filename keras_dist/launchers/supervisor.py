"""The supervisor layer of `keras-dist launch` and `keras-dist tune`.

A process group (`Group`): it spawns one process per worker, pumps and
prefixes their output (and tees it into log files), forwards signals, stops
the group with a grace period, and tells what happened to it (`Outcome`):
an exit, a port conflict, a hang (through `_liveness`), a preemption. The
train launcher (`train.py`) and the search launcher (`search.py`) decide
what to do about it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from keras_dist import _cluster, _exit_codes, _liveness

_TAIL_LINES = 40
# A failed worker's report on the console: its last lines (all of them are
# in its log file).
_SHOWN_LINES = 10
# Output kept per worker without a log directory, written to a file when
# the worker fails (the console shows a few lines and names the file).
_KEPT_LINES = 5000
# A traceback on the console waits this long, or for its worker's exit: a
# worker that lost its peer prints one as the launcher stops the group, and
# it is then summed up in one line instead of filling the console.
_HOLD_SECONDS = 1.0
_TRACEBACK = "Traceback (most recent call last):"
# What a worker prints when a peer it trains with died or was stopped: the
# consequence of another worker's failure, not its cause.
_LOST_PEER_MARKERS = (
    "UnavailableError", "Connection reset by peer", "failed to connect to all addresses",
    "Socket closed", "Connection refused", "CancelledError", "Broken pipe",
    "Collective ops is aborted",
)
HANG_EXIT_CODE = _exit_codes.HANG
PREEMPTED_EXIT_CODE = _exit_codes.PREEMPTED


def say(message: str) -> None:
    sys.stderr.write(f"[keras-dist] {message}\n")
    sys.stderr.flush()


@dataclass
class Worker:
    label: str  # "worker 0": the prefix of its lines; "worker-0.log" its log
    proc: subprocess.Popen
    tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    reader: threading.Thread | None = None
    watch: _liveness.Watch | None = None
    # Every line (without a log directory: for the file a failure names).
    output: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=_KEPT_LINES)
    )
    held: list = field(default_factory=list)  # console lines held back
    held_since: float | None = None


@dataclass
class Outcome:
    code: int
    reason: str = ""
    interrupted: bool = False
    port_conflict: bool = False
    stopped_to_resize: bool = False


# What TensorFlow prints when its gRPC server cannot bind its port: in local
# mode another process took a port between our reservation and the worker's
# bind. Such starts are retried with fresh ports, not counted as restarts.
_PORT_CONFLICT_MARKERS = ("Could not start gRPC server", "Address already in use")
PORT_RETRIES = 3
# How long a group asked to save and exit (for a resize, or on Ctrl-C or
# SIGTERM to the launcher) gets to do so.
RESIZE_SAVE_SECONDS = 60.0

# Lines TensorFlow prints at every start that say nothing about the job (no
# GPU on this machine, CPU build flags, a tf.data optimization note). Without
# --verbose they stay out of the console and of the report of a failed
# worker (log files keep everything). TensorFlow's C++ INFO lines are off
# unless the user sets TF_CPP_MIN_LOG_LEVEL.
_STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "failed call to cuInit",
    "Could not find cuda drivers",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "cpu_feature_guard.cc",
    "To enable the following instructions:",
    "oneDNN custom operations are on",
    "Input of GeneratorDatasetOp::Dataset will not be optimized",
    # keras_dist configures collective ops at import (before TensorFlow
    # starts); TensorFlow still warns when the strategy enables them again.
    "Enabling collective ops after program startup",
)
# Progress lines that keras_dist prints in launched processes: shown on the
# console also when the output goes to log files.
_PROGRESS_PREFIX = "[keras-dist] "


def python_command(script: str, script_args: Sequence[str], module: bool) -> list:
    """The argv after the interpreter: a script path, or `-m module`."""
    return (["-m", script] if module else [script]) + list(script_args)


def _is_noise(line: str) -> bool:
    return any(marker in line for marker in _STARTUP_NOISE)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def signal_name(signum: int) -> str:
    """How the console names a signal the launcher received."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal(workers, signum: int) -> None:
    for worker in workers:
        if worker.proc.poll() is None:
            try:
                os.killpg(worker.proc.pid, signum)
            except ProcessLookupError:
                pass


def await_exit(workers, seconds: float) -> None:
    """Waits up to `seconds` for `workers` to exit by themselves."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(0.05)


def stop_workers(workers, grace_period: float, signum: int = signal.SIGTERM) -> None:
    """Sends `signum` to `workers`, waits the grace period, kills the rest."""
    _signal(workers, signum)
    await_exit(workers, grace_period)
    _signal(workers, signal.SIGKILL)
    for worker in workers:
        worker.proc.wait()
        worker.reader.join(timeout=5)


@contextlib.contextmanager
def forwarded_signals():
    """Collects SIGINT/SIGTERM (in the main thread) into the list it yields."""
    interrupt: list[int] = []
    previous = {}

    def on_signal(signum, frame):
        interrupt.append(signum)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        yield interrupt
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted(name: str, codes, saved, at_once: bool, limit: float) -> str:
    """The closing line of an interrupted job."""
    if at_once:
        return (f"interrupted: {name} twice, the workers were stopped at once, "
                "without a save; run the same command again to resume from the "
                "last backup saved before, if any")
    if any(code is None for code in codes):
        return (f"interrupted: the workers did not exit within {limit:g}s and were "
                "stopped, without a save; run the same command again to resume "
                "from the last backup saved before, if any")
    if codes and all(code == 0 for code in codes):
        return "interrupted: the workers exited with code 0"
    if codes and all(code == PREEMPTED_EXIT_CODE for code in codes):
        note = next((s for s in saved if s), None)
        where = (f" in {note['backup_dir']} at epoch {note['epoch']}, step {note['step']}"
                 if note else "")
        return (f"interrupted: the workers saved a backup{where}; run the same "
                "command again to resume from there")
    return ("interrupted: the workers stopped without a save (no keras_dist "
            "BackupAndRestore was training); run the same command again to "
            "start over, or resume from the script's own checkpoints")


def _not_joining(worker: Worker) -> str:
    if worker.proc.poll() is not None:
        return "exited"
    if worker.watch.last is None:
        return "keras_dist not imported yet"
    return "no multi-worker strategy created yet"


def lost_peer(worker: Worker) -> bool:
    """Whether a worker's failure reads as the loss of a peer (an error
    exit after a gRPC or collective error), not a cause of its own."""
    code = worker.proc.poll()
    if code is None or code <= 0 or code == PREEMPTED_EXIT_CODE:
        return False
    return _reads_as_lost_peer(worker)


def _reads_as_lost_peer(worker: Worker) -> bool:
    text = "".join(worker.held) or "".join(worker.tail)
    return any(marker in text for marker in _LOST_PEER_MARKERS)


def _in_cluster(tf_config: str | None) -> bool:
    """Whether a process's TF_CONFIG makes it one of several workers."""
    cluster = _cluster.parse_tf_config(tf_config) if tf_config else None
    return cluster is not None and cluster.num_workers > 1


class Group:
    """One generation of worker processes, supervised together."""

    def __init__(self, command, processes, log_dir, grace_period, verbose=False,
                 annotate=None, timeouts=None, hold_tracebacks=False):
        """Starts `python -u *command` once per process.

        `processes`: (label, environment variables to set) per process.
        `annotate(group, label, line)`: may rewrite a progress line before it
        is shown. `timeouts`: the liveness limits (`_liveness.Timeouts`).
        `hold_tracebacks`: the group is supervised by `wait`, which says the
        first failure's cause first and sums up the others' in a line each.
        """
        self.hold_tracebacks = hold_tracebacks
        self.grace_period = grace_period
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.log_dir = log_dir
        self.verbose = verbose
        self.annotate = annotate
        self.timeouts = timeouts or _liveness.Timeouts()
        self.started = time.monotonic()
        self.heartbeats = tempfile.mkdtemp(prefix=_liveness.FOLDER_PREFIX)
        self._next_check = 0.0
        self._training_since = None  # when every worker had made a step
        self.failed = False  # from then on, the others' output stays off the console
        self._told_waiting = False
        self._log_copies = None  # where output is written for a report, without log_dir
        for label, variables in processes:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env[_cluster.LAUNCHED_ENV] = "1"
            heartbeat = os.path.join(self.heartbeats, label.replace(" ", "-"))
            env[_liveness.ENV] = heartbeat
            env[_liveness.PARENT_ENV] = str(os.getpid())
            if not verbose:
                env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
            for key, value in variables.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
            proc = subprocess.Popen(
                [sys.executable, "-u", *command],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                start_new_session=True,  # own process group: we stop it whole
            )
            worker = Worker(label, proc)
            worker.watch = _liveness.Watch(
                proc.pid, heartbeat, _in_cluster(variables.get("TF_CONFIG")),
                self.timeouts,
            )
            worker.reader = threading.Thread(
                target=self._pump, args=(worker,), daemon=True
            )
            worker.reader.start()
            self.workers.append(worker)

    def _pump(self, worker: Worker) -> None:
        log = None
        if self.log_dir:
            log = open(
                os.path.join(self.log_dir, f"{worker.label.replace(' ', '-')}.log"),
                "a",
                encoding="utf-8",
            )
        try:
            for line in worker.proc.stdout:
                noise = not self.verbose and _is_noise(line)
                if not noise:  # the tail explains a failure: no noise in it
                    worker.tail.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                    show = line.startswith(_PROGRESS_PREFIX)
                else:
                    worker.output.append(line)
                    show = not noise
                if show and self._hold(worker, line):
                    continue
                if show:
                    if self.annotate is not None and line.startswith(_PROGRESS_PREFIX):
                        line = self.annotate(self, worker.label, line)
                    with self.lock:
                        sys.stdout.write(f"[{worker.label}] {line}")
                        sys.stdout.flush()
        finally:
            if log is not None:
                log.close()

    def _hold(self, worker: Worker, line: str) -> bool:
        """Keeps a console line back: from a traceback on (until its worker
        exits, or `_HOLD_SECONDS`), and every line once a worker failed."""
        if not self.hold_tracebacks or (line.startswith(_PROGRESS_PREFIX) and not self.failed):
            return False
        with self.lock:
            if not (self.failed or worker.held or line.startswith(_TRACEBACK)):
                return False
            worker.held.append(line)
            if worker.held_since is None:
                worker.held_since = time.monotonic()
            return True

    def release_held(self, everything: bool = False) -> None:
        """Shows held lines of a worker that is still running after
        `_HOLD_SECONDS` (a traceback it printed and went on), or of every
        worker (`everything`: the group succeeded)."""
        if self.failed:
            return
        now = time.monotonic()
        with self.lock:
            for worker in self.workers:
                if worker.held and (everything or (
                        worker.proc.poll() is None and now - worker.held_since > _HOLD_SECONDS)):
                    sys.stdout.write("".join(f"[{worker.label}] {line}" for line in worker.held))
                    sys.stdout.flush()
                    worker.held, worker.held_since = [], None

    def log_file(self, worker: Worker) -> str:
        """Where all of `worker`'s output is: its log file, or a copy of
        what it printed, written now."""
        name = f"{worker.label.replace(' ', '-')}.log"
        if self.log_dir:
            return os.path.join(self.log_dir, name)
        if self._log_copies is None:
            self._log_copies = tempfile.mkdtemp(prefix="keras_dist_logs_")
        path = os.path.join(self._log_copies, name)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(list(worker.output))
        return path

    def last_lines(self, worker: Worker) -> str:
        """A failed worker's last lines for the console, and where the rest is."""
        lines = "".join(list(worker.tail)[-_SHOWN_LINES:]).rstrip()
        return (f"last lines of {worker.label}'s output (all of it in "
                f"{self.log_file(worker)}):\n{lines}")

    def consequence(self, worker: Worker) -> str:
        """One line for a worker that failed after the first failure."""
        held = [line.strip() for line in worker.held if line.strip()]
        last = held[-1] if held else "no output"
        what = "lost its peer" if _reads_as_lost_peer(worker) else "failed too"
        return (f"{worker.label} {what}: {last[:200]} ({len(held)} lines, all of "
                f"its output in {self.log_file(worker)})")

    def signal_all(self, signum: int) -> None:
        _signal(self.workers, signum)

    def tell_peer_lost(self, reason: str) -> None:
        """Tells the running workers that a worker failed: each aborts the
        collectives it waits in (`_liveness.PEER_LOST`) and ends through
        its own error path; a worker blocked in a collective outside a step
        otherwise waits for its dead peer until the grace period ends."""
        path = os.path.join(self.heartbeats, _liveness.PEER_LOST)
        with contextlib.suppress(OSError):
            with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                f.write(f"the job lost a worker ({reason})")
            os.replace(f"{path}.tmp", path)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Sends `signum`, waits the grace period, then kills what is left."""
        stop_workers(self.workers, self.grace_period, signum)
        shutil.rmtree(self.heartbeats, ignore_errors=True)

    def unresponsive(self, workers=None):
        """(worker, what is wrong) for the first running worker that hangs,
        never joined or stopped responding; checked about once a second."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + 1.0
        found = []
        for index, worker in enumerate(workers if workers is not None else self.workers):
            if worker.proc.poll() is None and worker.watch is not None:
                problem = worker.watch.check()
                if problem:
                    found.append((problem[0], index, worker, problem[1]))
        if not found:
            return None
        rank, _, worker, problem = min(found, key=lambda f: f[:2])
        if rank >= 4:
            # It waits inside a step or a collective: for a peer that is
            # outside one, stuck in the script, if there is such a peer.
            for other in (workers if workers is not None else self.workers):
                if other is worker or other.proc.poll() is not None or other.watch is None:
                    continue
                stalled = other.watch.stalled_outside_a_step()
                if stalled:
                    return other, stalled[1]
        return worker, problem

    def _tell_waits(self, workers) -> None:
        """Says once that workers have waited long for their peers to join
        the cluster, and which peers are not joining yet."""
        if self._told_waiting:
            return
        waits = [(w.label, w.watch.waiting()) for w in workers
                 if w.watch is not None and w.proc.poll() is None]
        waits = [(label, waited) for label, waited in waits if waited is not None]
        limit = self.timeouts.start
        after = min(_liveness.WAIT_NOTICE_AFTER, limit / 4) if limit else _liveness.WAIT_NOTICE_AFTER
        if not waits or max(waited for _, waited in waits) < after:
            return
        self._told_waiting = True
        behind = [f"{w.label} ({_not_joining(w)})" for w in self.workers
                  if w.watch is not None and not (w.watch.last or {}).get("joining")
                  and not (w.watch.last or {}).get("joined")]
        say(f"{', '.join(label for label, _ in waits)} waited "
            f"{max(waited for _, waited in waits):.0f}s for the other workers to join the "
            "cluster" + (f"; not joining yet: {', '.join(behind)}" if behind else "")
            + (f"; the job stops at --start-timeout {limit:g}s" if limit else ""))

    def report_hang(self, worker, problem: str) -> str:
        """Says which worker hangs and how, with its last lines."""
        reason = f"{worker.label} {problem}"
        others = [
            f"{w.label}: {w.watch.summary()}" for w in self.workers
            if w is not worker and w.watch is not None and w.proc.poll() is None
        ]
        say(f"{reason}" + (f" (others: {'; '.join(others)})" if others else ""))
        say(self.last_lines(worker))
        return reason

    def stopped_peer(self, failed) -> str:
        """'worker 1 stopped responding (...)' when a stopped peer probably
        caused `failed` to fail; '' otherwise."""
        for worker in self.workers:
            if worker is failed or worker.proc.poll() is not None:
                continue
            stopped, state = _liveness.is_stopped(worker.proc.pid)
            if stopped:
                return (
                    f"{worker.label} stopped responding: its process is stopped "
                    f"(state {state}: SIGSTOP, or a debugger)"
                )
        return ""

    def wait(self, interrupt: list[int], resize_after: float | None = None) -> Outcome:
        """Supervises the group until it ends; one handler per event.

        `resize_after`: seconds after every worker's first step at which the
        group is asked to save and exit (SIGTERM), so that the job can go on
        at another size.
        """
        while True:
            self.release_held()
            outcome = (
                self._on_interrupt(interrupt)
                or self._on_failure()
                or self._on_success()
                or self._on_hang()
                or self._on_resize_time(resize_after)
            )
            if outcome is not None:
                return outcome
            time.sleep(0.05)

    def _on_interrupt(self, interrupt: list[int]) -> Outcome | None:
        """Ctrl-C or SIGTERM to the launcher: the workers are asked to save
        and exit (SIGTERM: `BackupAndRestore` saves at the next step on every
        worker and exits 42; a worker without one just ends); a second
        signal stops them at once. The last line says which happened and
        what to run next."""
        if not interrupt:
            return None
        signum = interrupt[0]
        name = signal_name(signum)
        limit = max(self.grace_period, RESIZE_SAVE_SECONDS)
        say(f"received {name}: asking the workers to save a backup within two "
            f"steps and exit (up to {limit:g}s; {name} again stops them at once)")
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + limit
        at_once = False
        while any(w.proc.poll() is None for w in self.workers):
            if len(interrupt) > 1:
                at_once = True
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        codes = [w.proc.poll() for w in self.workers]
        saved = [(_liveness.read(w.watch.heartbeat) or {}).get("saved") if w.watch else None
                 for w in self.workers]
        if at_once:
            self.signal_all(signal.SIGKILL)
        self.stop()  # what is left, after the grace period
        say(_interrupted(name, codes, saved, at_once, limit))
        return Outcome(128 + signum, "interrupted", interrupted=True)

    def _on_failure(self) -> Outcome | None:
        """A worker that exited with an error stops the group. The cause is
        said first: a worker that failed on its own (a signal, an error of
        its own) before one that only lost its peer; the others' failures
        that follow are one line each."""
        failed = [w for w in self.workers if w.proc.poll() not in (None, 0)]
        if not failed:
            return None
        self.failed = True
        for worker in failed:
            worker.reader.join(timeout=2)
        worker = min(failed, key=lambda w: (lost_peer(w), self.workers.index(w)))
        code = worker.proc.poll()
        reason = f"{worker.label} {describe_exit(code)}"
        if code == PREEMPTED_EXIT_CODE:
            reason += " (preempted: it saved a backup)"
            # The others agreed to save and exit too: let them.
            await_exit(self.workers, self.grace_period)
        cause = self.stopped_peer(worker)
        if cause:
            reason = f"{cause}; {reason} (its peer stopped answering)"
        say(f"{reason}; stopping the other workers")
        if code != PREEMPTED_EXIT_CODE:
            self.tell_peer_lost(reason)
        self.stop()
        tail = "".join(worker.tail)
        say(self.last_lines(worker))
        for other in self.workers:
            if other is not worker and other.held:
                say(self.consequence(other))
        return Outcome(
            HANG_EXIT_CODE if cause else exit_status(code),
            reason,
            port_conflict=any(m in tail for m in _PORT_CONFLICT_MARKERS),
        )

    def _on_success(self) -> Outcome | None:
        if any(w.proc.poll() != 0 for w in self.workers):
            return None
        for worker in self.workers:
            worker.reader.join(timeout=5)
        self.release_held(everything=True)
        notice = self.no_cluster_notice()
        if notice:
            say(notice)
        shutil.rmtree(self.heartbeats, ignore_errors=True)
        return Outcome(0)

    def no_cluster_notice(self) -> str:
        """What to say when the workers of a multi-worker group never formed
        a cluster: each trained a model of its own on all the data."""
        watches = [w.watch for w in self.workers if w.watch is not None]
        if len(watches) < 2 or not all(w.multi_worker for w in watches):
            return ""
        beats = [_liveness.read(w.heartbeat) or w.last for w in watches]
        if any((beat or {}).get("joined") for beat in beats):
            return ""
        why = (
            "the script never imported keras_dist"
            if all(beat is None for beat in beats)
            else "keras_dist was imported, but no multi-worker strategy was created"
        )
        return (
            f"warning: the {len(watches)} workers never formed a multi-worker "
            f"cluster ({why}): each trained a model of its own, on all the data. "
            "Train through keras_dist (keras_dist.distribute(model), a "
            "keras_dist.DistributedModel, or keras_dist.resolve_strategy('auto') "
            "and its scope) for one model trained by all workers."
        )

    def _on_hang(self) -> Outcome | None:
        hung = self.unresponsive()
        self._tell_waits(self.workers)  # read from the checks just made
        if hung is None:
            return None
        reason = self.report_hang(*hung)
        say("stopping the workers")
        self.stop()
        return Outcome(HANG_EXIT_CODE, reason)

    def stop_to_resize(self, save: bool) -> list[int | None]:
        """Sends SIGTERM and stops the group; each worker's exit code before
        the kill (None: still running). `save`: the workers are healthy and
        get time to save (BackupAndRestore saves at the next step boundary
        and exits 42 on every worker); otherwise the grace period."""
        self.signal_all(signal.SIGTERM)
        await_exit(self.workers,
                   max(self.grace_period, RESIZE_SAVE_SECONDS) if save else self.grace_period)
        codes = [w.proc.poll() for w in self.workers]
        self.stop()
        return codes

    def _on_resize_time(self, resize_after: float | None) -> Outcome | None:
        if resize_after is None:
            return None
        if self._training_since is None:
            # The heartbeats (read by the hang checks, about once a second)
            # count the steps: the clock starts when every worker trains.
            if all(w.watch is not None and (w.watch.last or {}).get("steps", 0) > 0
                   for w in self.workers):
                self._training_since = time.monotonic()
            return None
        if time.monotonic() - self._training_since < resize_after:
            return None
        codes = self.stop_to_resize(save=True)
        if codes == [0] * len(codes):
            for worker in self.workers:
                worker.reader.join(timeout=5)
            return Outcome(0)
        failed = [(w, c) for w, c in zip(self.workers, codes) if c != PREEMPTED_EXIT_CODE]
        if not failed:
            return Outcome(PREEMPTED_EXIT_CODE, "saved", stopped_to_resize=True)
        worker, code = failed[0]
        return Outcome(
            exit_status(-9 if code is None else code),
            f"{worker.label} " + ("did not exit in time" if code is None
                                  else describe_exit(code)),
            stopped_to_resize=True,
        )
