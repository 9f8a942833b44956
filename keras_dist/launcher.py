"""`launch`: start and supervise the workers of a multi-worker job."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Sequence

from keras_dist import _cluster_spec
from keras_dist import _exit_codes
from keras_dist import _liveness
from keras_dist import _netns
from keras_dist import _tf_config
from keras_dist._checks import check_log_dir, check_script, check_seconds

_TAIL_LINES = 40
HANG_EXIT_CODE = _exit_codes.HANG
PREEMPTED_EXIT_CODE = _exit_codes.PREEMPTED


def _say(message: str) -> None:
    sys.stderr.write(f"[keras-dist] {message}\n")
    sys.stderr.flush()


@dataclass
class _Worker:
    label: str  # "worker 0": the prefix of its lines; "worker-0.log" its log
    proc: subprocess.Popen
    tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    reader: threading.Thread | None = None
    watch: _liveness.Watch | None = None


@dataclass
class _Outcome:
    code: int
    reason: str = ""
    interrupted: bool = False
    port_conflict: bool = False


# What TensorFlow prints when its gRPC server cannot bind its port: in local
# mode another process took a port between our reservation and the worker's
# bind. Such starts are retried with fresh ports, not counted as restarts.
_PORT_CONFLICT_MARKERS = ("Could not start gRPC server", "Address already in use")
_PORT_RETRIES = 3

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


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
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


class _Group:
    """One generation of worker processes, supervised together."""

    def __init__(self, command, processes, log_dir, grace_period, verbose=False,
                 annotate=None, timeouts=None):
        """Starts `python -u *command` once per process.

        `processes`: (label, environment variables to set) per process.
        `annotate(group, label, line)`: may rewrite a progress line before it
        is shown. `timeouts`: the liveness limits (`_liveness.Timeouts`).
        """
        self.grace_period = grace_period
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.log_dir = log_dir
        self.verbose = verbose
        self.annotate = annotate
        self.timeouts = timeouts or _liveness.Timeouts()
        self.started = time.monotonic()
        self.heartbeats = tempfile.mkdtemp(prefix="keras_dist_heartbeat_")
        self._next_check = 0.0
        for label, variables in processes:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env[_cluster_spec.LAUNCHED_ENV] = "1"
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
            worker = _Worker(label, proc)
            worker.watch = _liveness.Watch(
                proc.pid, heartbeat, _in_cluster(variables.get("TF_CONFIG")),
                self.timeouts,
            )
            worker.reader = threading.Thread(
                target=self._pump, args=(worker,), daemon=True
            )
            worker.reader.start()
            self.workers.append(worker)

    def _pump(self, worker: _Worker) -> None:
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
                    show = not noise
                if show:
                    if self.annotate is not None and line.startswith(_PROGRESS_PREFIX):
                        line = self.annotate(self, worker.label, line)
                    with self.lock:
                        sys.stdout.write(f"[{worker.label}] {line}")
                        sys.stdout.flush()
        finally:
            if log is not None:
                log.close()

    def signal_all(self, signum: int) -> None:
        _signal(self.workers, signum)

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
        _, _, worker, problem = min(found, key=lambda f: f[:2])
        return worker, problem

    def report_hang(self, worker, problem: str) -> str:
        """Says which worker hangs and how, with its last lines."""
        reason = f"{worker.label} {problem}"
        others = [
            f"{w.label}: {w.watch.summary()}" for w in self.workers
            if w is not worker and w.watch is not None and w.proc.poll() is None
        ]
        _say(f"{reason}" + (f" (others: {'; '.join(others)})" if others else ""))
        _say(f"last lines of {worker.label}'s output:\n{''.join(worker.tail).rstrip()}")
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

    def wait(self, interrupt: list[int]) -> _Outcome:
        while True:
            if interrupt:
                signum = interrupt[0]
                _say(
                    f"received {signal.Signals(signum).name}: forwarding it to "
                    f"the workers (grace period {self.grace_period:g}s)"
                )
                self.stop(signum)
                return _Outcome(128 + signum, "interrupted", interrupted=True)
            codes = [w.proc.poll() for w in self.workers]
            for worker, code in zip(self.workers, codes):
                if code not in (None, 0):
                    worker.reader.join(timeout=2)
                    reason = f"{worker.label} {_describe_exit(code)}"
                    if code == PREEMPTED_EXIT_CODE:
                        reason += " (preempted: it saved a backup)"
                        # The others agreed to save and exit too: let them.
                        await_exit(self.workers, self.grace_period)
                    cause = self.stopped_peer(worker)
                    if cause:
                        reason = f"{cause}; {reason} (its peer stopped answering)"
                    _say(f"{reason}; stopping the other workers")
                    self.stop()
                    tail = "".join(worker.tail)
                    _say(f"last lines of {worker.label}'s output:\n{tail.rstrip()}")
                    return _Outcome(
                        HANG_EXIT_CODE if cause else _exit_status(code),
                        reason,
                        port_conflict=any(m in tail for m in _PORT_CONFLICT_MARKERS),
                    )
            if all(code == 0 for code in codes):
                for worker in self.workers:
                    worker.reader.join(timeout=5)
                shutil.rmtree(self.heartbeats, ignore_errors=True)
                return _Outcome(0)
            hung = self.unresponsive()
            if hung is not None:
                reason = self.report_hang(*hung)
                _say("stopping the workers")
                self.stop()
                return _Outcome(HANG_EXIT_CODE, reason)
            time.sleep(0.05)



def _in_cluster(tf_config: str | None) -> bool:
    """Whether a process's TF_CONFIG makes it one of several workers."""
    cluster = _tf_config.parse_tf_config(tf_config) if tf_config else None
    return cluster is not None and cluster.num_workers > 1


def launch(
    script: str,
    script_args: Sequence[str] = (),
    *,
    num_workers: int | None = None,
    hosts: str | None = None,
    rank: int | None = None,
    max_restarts: int = 0,
    log_dir: str | None = None,
    grace_period: float = 5.0,
    module: bool = False,
    port: int | None = None,
    verbose: bool = False,
    start_timeout: float | None = 300.0,
    hang_timeout: float | None = 900.0,
    private_network: bool = False,
) -> int:
    """Runs `script` as the workers of a multi-worker job and supervises them.

    Local mode (`num_workers=N`) starts N processes of the script on this
    machine, each with its own `TF_CONFIG` (N workers on free 127.0.0.1
    ports), so `keras_dist.resolve_strategy("auto")` gives each a
    `MultiWorkerMirroredStrategy`. Multi-host mode (`hosts=..., rank=I`)
    starts this host's worker only; run it once per host. Inside a Slurm
    allocation (neither given) the cluster comes from Slurm's variables.

    Each output line is prefixed with its worker's rank (or written to
    `log_dir/worker-<rank>.log`). When a worker exits with an error or is
    killed, the others are stopped at once (no hang in a collective): the
    launcher reports which worker failed, how, and its last lines. With
    `max_restarts=K` the whole group is restarted (fresh ports) up to K
    times, so a job that backs itself up resumes by itself. SIGINT/SIGTERM
    are forwarded to the workers, which get `grace_period` seconds to exit.

    Hangs are detected without any network listener: each worker writes a
    heartbeat file that the launcher reads. A worker that has not joined
    its cluster after `start_timeout` seconds, that makes no step (train,
    test or predict call) for `hang_timeout` seconds after it joined, or
    whose process is stopped (SIGSTOP, a debugger) or silent without using
    CPU for 15 s, is named with its last lines; the group is stopped
    (exit status 124) and restarted if `max_restarts` allows. A worker that
    exits 42 (a `BackupAndRestore` preemption save) gets the grace period
    for the others to finish their save too.

    Args:
        script: Path of the Python script every worker runs.
        script_args: Arguments passed to the script.
        num_workers: Positive integer: local mode with this many workers.
        hosts: `"host1:port,host2:port"`: multi-host mode (needs `rank`).
        rank: This host's index in `hosts`.
        max_restarts: Non-negative integer, default 0: group restarts after
            a failure.
        log_dir: Directory for per-worker log files (default: prefixed
            lines on standard output).
        grace_period: Positive number of seconds, default 5, that workers
            get to exit after SIGTERM/SIGINT before they are killed.
        module: Boolean, default False: `script` names a module, run as
            `python -m script` (like `python -m`, found from the current
            directory or the installed packages).
        port: Local mode only: the first worker's port on 127.0.0.1; worker
            `i` gets `port + i` (default: free ports chosen by the system).
        verbose: Boolean, default False: show TensorFlow's start-up lines
            (no GPU found, CPU build flags, C++ INFO logs) on the console;
            without it they are kept out of the console (log files and the
            report of a failed worker keep what the worker printed).
        start_timeout: Seconds (default 300) each worker of a multi-worker
            group gets to join its cluster; None: no limit.
        hang_timeout: Seconds (default 900) a worker may go without a step
            once it joined its cluster; None: no limit.
        private_network: Boolean, default False. Local mode on Linux: run
            the job in its own network namespace, whose only interface is a
            private loopback. TensorFlow's servers listen on every interface
            (it has no setting for that); in the namespace nothing outside
            can reach them, and the workers cannot reach the network.

    Returns:
        0 when every worker succeeded; otherwise the failed worker's exit
        code (128 + signal number for a signal; 124 for a hang).

    Example:

        >>> import keras_dist
        >>> keras_dist.launch("train.py", ["--epochs", "3"], num_workers=2)  # doctest: +SKIP
        0

    Raises:
        ValueError / TypeError: before anything starts, for a missing
            script, `num_workers < 1`, a malformed `hosts`, a rank out of
            range, a port in use or bad restart/grace values.
    """
    configs_for = _plan(script, num_workers, hosts, rank, max_restarts, log_dir,
                        grace_period, module, port)
    timeouts = _liveness.Timeouts.checked(start_timeout, hang_timeout)
    if private_network and not _netns.inside():
        if num_workers is None:
            raise ValueError(
                "Invalid value for argument `private_network`: it isolates a "
                "local job (num_workers=N); a multi-host job needs the "
                "network. Received: private_network=True with hosts="
                f"{hosts!r}. Keep multi-host jobs on a private network or "
                "behind a firewall."
            )
        return _netns.relaunch(
            ["launch", "--num-workers", str(num_workers),
             "--max-restarts", str(max_restarts)],
            script, script_args, port=port, log_dir=log_dir,
            grace_period=grace_period, module=module, verbose=verbose,
            start_timeout=start_timeout, hang_timeout=hang_timeout,
        )
    _netns.set_up_if_inside()
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    command = python_command(script, script_args, module)
    started = time.monotonic()
    with forwarded_signals() as interrupt:
        restarts = 0
        port_retries = 0
        while True:
            configs = configs_for()
            processes = [(f"worker {r}", {"TF_CONFIG": c}) for r, c in configs]
            _say(
                ("restart: " if restarts or port_retries else "")
                + f"starting {_describe_workers(configs)}: python "
                + " ".join(command)
                + (f" (output in {log_dir}/worker-<rank>.log)" if log_dir else "")
            )
            group = _Group(command, processes, log_dir, grace_period, verbose,
                           timeouts=timeouts)
            outcome = group.wait(interrupt)
            if (
                outcome.port_conflict
                and num_workers is not None
                and port is None
                and port_retries < _PORT_RETRIES
            ):
                port_retries += 1
                _say(
                    "a worker could not bind its port (taken by another "
                    f"process); retrying with fresh ports ({port_retries}/"
                    f"{_PORT_RETRIES})"
                )
                continue
            if outcome.code == 0:
                _say(
                    f"job finished: {len(configs)} worker(s) exited with code 0 "
                    f"after {time.monotonic() - started:.1f}s"
                    + (f" and {restarts} restart(s)" if restarts else "")
                )
                return 0
            if outcome.interrupted or restarts >= max_restarts:
                if not outcome.interrupted:
                    _say(
                        f"job failed: {outcome.reason}"
                        + (f" (after {restarts} restart(s))" if restarts else "")
                    )
                return outcome.code
            restarts += 1
            _say(
                f"restarting the worker group ({restarts}/{max_restarts}) "
                f"because {outcome.reason}"
            )


def _describe_workers(configs) -> str:
    """'2 workers (127.0.0.1:5001, 127.0.0.1:5002)' or 'worker 1 of 2 (...)'."""
    cluster = json.loads(configs[0][1])["cluster"]["worker"]
    if len(configs) == len(cluster):
        return f"{len(cluster)} worker(s) ({', '.join(cluster)})"
    rank = configs[0][0]
    return f"worker {rank} of {len(cluster)} ({cluster[rank]})"


def _plan(script, num_workers, hosts, rank, max_restarts, log_dir, grace_period,
          module=False, port=None):
    """Validates everything up front; returns a TF_CONFIG factory."""
    check_script(script, "training", module)
    for name, value in (("max_restarts", max_restarts),):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"Invalid value for argument `{name}`. Expected a non-negative "
                f"integer. Received: {name}={value!r}."
            )
    check_seconds("grace_period", grace_period)
    check_log_dir(log_dir)
    if num_workers is not None and hosts is not None:
        raise ValueError(
            "Arguments `num_workers` and `hosts` are mutually exclusive. "
            f"Received: num_workers={num_workers!r}, hosts={hosts!r}. Use "
            "num_workers for local workers, hosts (with rank) for one host "
            "of a multi-host job."
        )
    if num_workers is not None:
        if (
            not isinstance(num_workers, int)
            or isinstance(num_workers, bool)
            or num_workers < 1
        ):
            raise ValueError(
                "Invalid value for argument `num_workers`. Expected a positive "
                f"integer. Received: num_workers={num_workers!r}."
            )

        if port is not None:
            fixed = _cluster_spec.consecutive_ports(port, num_workers)

        def local():
            ports = fixed if port is not None else _cluster_spec.loopback_ports(num_workers)
            workers = [f"127.0.0.1:{p}" for p in ports]
            return [(r, _cluster_spec.tf_config(workers, r)) for r in range(num_workers)]

        return local
    if port is not None:
        raise ValueError(
            "Argument `port` applies to local workers (num_workers=N) only. "
            f"Received: port={port!r}, hosts={hosts!r}. With hosts, each "
            "entry names its port (host:port)."
        )
    if hosts is not None:
        workers = _cluster_spec.parse_hosts(hosts)
        if rank is None:
            raise ValueError(
                "Argument `rank` is required with `hosts`: the index of this "
                f"host in the list. Received: rank=None, hosts={hosts!r}."
            )
        _cluster_spec.check_rank(rank, len(workers))
        _cluster_spec.check_port_free(workers[rank])
        config = _cluster_spec.tf_config(workers, rank)
        return lambda: [(rank, config)]
    slurm = _cluster_spec.slurm_cluster()
    if slurm is not None:
        workers, slurm_rank = slurm
        config = _cluster_spec.tf_config(workers, slurm_rank)
        return lambda: [(slurm_rank, config)]
    raise ValueError(
        "No cluster given. Pass num_workers=N (--num-workers N) for N local "
        "workers, or hosts='h1:port,h2:port' with rank=I (--hosts, --rank) "
        "on each host, or run inside a Slurm allocation (srun)."
    )


def planned_tf_configs(
    num_workers: int | None = None, hosts: str | None = None
) -> list[str]:
    """The `TF_CONFIG` of every worker that `launch` would start.

    For local mode the ports are chosen now; a later `launch` picks fresh
    ones. For `hosts`, the result is exactly what each host's worker gets.
    """
    if hosts is not None:
        workers = _cluster_spec.parse_hosts(hosts)
    elif num_workers is not None and isinstance(num_workers, int) and num_workers >= 1:
        workers = [f"127.0.0.1:{p}" for p in _cluster_spec.loopback_ports(num_workers)]
    else:
        slurm = _cluster_spec.slurm_cluster()
        if slurm is None:
            raise ValueError(
                "Pass --num-workers N or --hosts h1:port,h2:port with "
                f"--print-tf-config. Received: num_workers={num_workers!r}, "
                f"hosts={hosts!r}."
            )
        workers = slurm[0]
    return [_cluster_spec.tf_config(workers, r) for r in range(len(workers))]
