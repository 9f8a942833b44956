"""`launch_search`: start and supervise a distributed keras-tuner search."""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Sequence

from keras_dist import _cluster, _liveness, _netns
from keras_dist._checks import (
    check_count,
    check_launch_arguments,
    check_local_workers,
    check_seconds,
)
from keras_dist.launchers import gpus
from keras_dist.launchers.supervisor import (
    HANG_EXIT_CODE,
    Group,
    await_exit,
    describe_exit,
    exit_status,
    forwarded_signals,
    python_command,
    say,
    signal_name,
    stop_workers,
)


def launch_search(
    script: str,
    script_args: Sequence[str] = (),
    *,
    num_workers: int,
    workers_per_trial: int = 1,
    port: int | None = None,
    log_dir: str | None = None,
    grace_period: float = 5.0,
    finish_timeout: float = 300.0,
    module: bool = False,
    verbose: bool = False,
    start_timeout: float | None = 300.0,
    hang_timeout: float | None = 900.0,
    private_network: bool | None = None,
    gpus_per_worker: int | None = None,
) -> int:
    """Runs `script` as the chief and tuner workers of a search; supervises them.

    Starts, on this machine, the chief (`KERASTUNER_TUNER_ID=chief`, which
    serves keras-tuner's gRPC oracle on 127.0.0.1 only: the service has no
    authentication) and `num_workers` tuner workers with
    `KERASTUNER_ORACLE_IP`/`KERASTUNER_ORACLE_PORT` pointing at it. With
    `workers_per_trial=M > 1`, the workers form groups of M that share a
    tuner id and a `TF_CONFIG` (M workers on loopback ports): each group is
    one `MultiWorkerMirroredStrategy` running one trial at a time. The script
    builds a tuner and calls `search`: a plain keras-tuner script
    (`keras_tuner.RandomSearch`, ...) runs unchanged with
    `workers_per_trial=1`; trial groups need a `keras_dist.tuner` tuner (a
    plain one is refused at once, naming the fix).

    The chief prints a progress line per finished trial (its
    hyperparameters, score, the best so far, and how many tuner workers are
    running), also when the output goes to log files.

    Output lines are prefixed `[chief]`, `[tuner0]`, `[tuner0 worker 1]`
    (or go to `log_dir/<label>.log`). A tuner worker that dies is reported
    (how, and its last lines) and the search goes on with the others: the
    chief ends its trial once it has been silent for the tuner's
    `worker_timeout` (failed, or retried per `max_retries_per_trial`); the
    other members of its trial group, stuck in a collective, are stopped.
    If every worker has died, or the chief has not finished
    `finish_timeout` seconds after the last worker exited, the chief is
    stopped. SIGINT/SIGTERM are forwarded to every process.

    Args:
        script: Path of the search script every process runs.
        script_args: Arguments passed to the script.
        num_workers: Positive integer: tuner worker processes (not counting
            the chief).
        workers_per_trial: Positive integer dividing `num_workers`, default
            1: processes that run each trial together.
        port: The oracle's port on 127.0.0.1 (default: a free one).
        log_dir: Directory for per-process log files (default: prefixed
            lines on standard output).
        grace_period: Positive number of seconds, default 5, that processes
            get to exit after SIGTERM before they are killed.
        finish_timeout: Positive number of seconds, default 300, that the
            chief gets to finish after the last tuner worker exited.
        module: Boolean, default False: `script` names a module
            (`python -m script`).
        verbose: Boolean, default False: show TensorFlow's start-up lines on
            the console (see `launch`).
        start_timeout: Seconds (default 300; None: no limit) a trial
            group's worker gets to join its cluster (see `launch`).
        hang_timeout: Seconds (default 900; None: no limit) a tuner worker
            may go without a step inside a trial. A tuner worker that hangs
            is stopped like one that died; a hung chief stops the search
            (exit status 124).
        private_network: True, False or None (the default: in its own
            network namespace where the machine can make one); see `launch`.
        gpus_per_worker: Non-negative integer or None (the default): the
            GPUs each tuner worker gets (`CUDA_VISIBLE_DEVICES`), as
            `launch` gives its workers: None splits this machine's GPUs
            evenly over the tuner workers, 0 hides them; an impossible
            split is refused before anything starts. Where tuner workers
            get GPUs, the chief (which trains nothing) gets none, so that
            it reserves no GPU memory.

    Returns:
        The chief's exit status: 0 when the search finished (even if some
        workers died: they are reported), else its exit code (128 + signal
        number for a signal), or 1 if every tuner worker died first.

    Example:

        >>> import keras_dist
        >>> keras_dist.launch_search("search.py", num_workers=2)  # doctest: +SKIP
        0

    Raises:
        ValueError: before anything starts, for a missing script, a bad
            count, `workers_per_trial` not dividing `num_workers`, a port in
            use, or bad timeouts.
    """
    _check(script, num_workers, workers_per_trial, port, log_dir,
           grace_period, finish_timeout, module)
    timeouts = _liveness.Timeouts.checked(start_timeout, hang_timeout)
    gpu_plan = gpus.plan(gpus.visible_gpus(), num_workers, gpus_per_worker)
    if _netns.wanted(private_network, local=True, received="a local search"):
        return _netns.relaunch(
            ["tune", "--num-workers", str(num_workers),
             "--workers-per-trial", str(workers_per_trial),
             "--finish-timeout", repr(float(finish_timeout)),
             *(["--gpus-per-worker", str(gpus_per_worker)]
               if gpus_per_worker is not None else [])],
            script, script_args, port=port, log_dir=log_dir,
            grace_period=grace_period, module=module, verbose=verbose,
            start_timeout=start_timeout, hang_timeout=hang_timeout,
        )
    _netns.set_up_if_inside()
    if workers_per_trial > 1 or _netns.inside():  # trial groups run TensorFlow servers
        say(_netns.exposure(local=True, private_network=private_network))
    if port is None:
        port = _cluster.loopback_ports(1)[0]
    oracle = {
        "KERASTUNER_ORACLE_IP": "127.0.0.1",
        "KERASTUNER_ORACLE_PORT": str(port),
        # The chief answers only calls that carry it: another local process
        # cannot read the search space, take a trial or report a score.
        "KERAS_DIST_ORACLE_SECRET": secrets.token_hex(32),
    }
    gpu_env = gpu_plan.environment if gpu_plan is not None else lambda index: {}
    hidden = {gpus.VISIBLE: ""} if gpu_plan is not None else {}
    processes = [("chief", dict(oracle, KERASTUNER_TUNER_ID="chief", TF_CONFIG=None,
                                **hidden))]
    groups: dict[str, list[str]] = {}
    for g in range(num_workers // workers_per_trial):
        tuner_id = f"tuner{g}"
        if workers_per_trial == 1:
            labels = [(tuner_id, None)]
        else:
            ports = _cluster.loopback_ports(workers_per_trial)
            cluster = [f"127.0.0.1:{p}" for p in ports]
            labels = [
                (f"{tuner_id} worker {r}", _cluster.tf_config(cluster, r))
                for r in range(workers_per_trial)
            ]
        groups[tuner_id] = [label for label, _ in labels]
        for r, (label, config) in enumerate(labels):
            processes.append((label, dict(oracle, KERASTUNER_TUNER_ID=tuner_id,
                                          TF_CONFIG=config,
                                          **gpu_env(g * workers_per_trial + r))))
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    say(
        f"search: chief (oracle on 127.0.0.1:{port}) and {num_workers} tuner "
        f"worker(s)"
        + (f" in {len(groups)} groups of {workers_per_trial}" if workers_per_trial > 1 else "")
    )
    if gpu_plan is not None:
        say(f"{gpu_plan.describe(num_workers)} (the tuner workers, in order; the "
            "chief trains nothing and gets none)")
    command = ["-m", "keras_dist._tune_run", *python_command(script, script_args, module)]

    def annotate(group, label, line):
        # The chief's trial lines gain the count of tuner workers running.
        if label != "chief" or not line.startswith("[keras-dist] trial "):
            return line
        running = sum(w.proc.poll() is None for w in group.workers[1:])
        return f"{line.rstrip()}; {running}/{num_workers} tuner workers running\n"

    with forwarded_signals() as interrupt:
        group = Group(command, processes, log_dir, grace_period, verbose, annotate,
                       timeouts)
        return _supervise(group, groups, interrupt, grace_period, finish_timeout)


def _supervise(group, groups, interrupt, grace_period, finish_timeout) -> int:
    return _SearchSupervisor(group, groups, interrupt, grace_period, finish_timeout).run()


class _SearchSupervisor:
    """Watches the chief and the tuner workers; one handler per event.

    Each poll runs the handlers in order; the first that returns an exit
    status ends the search with it.
    """

    def __init__(self, group, groups, interrupt, grace_period, finish_timeout):
        self.group = group
        self.chief, self.workers = group.workers[0], group.workers[1:]
        self.groups = groups
        self.by_label = {w.label: w for w in self.workers}
        self.group_of = {label: t for t, labels in groups.items() for label in labels}
        self.interrupt = interrupt
        self.grace_period = grace_period
        self.finish_timeout = finish_timeout
        self.reported: set[str] = set()  # dead or stopped workers, told once
        self.deaths: list[str] = []
        self.all_exited_at = None
        self.hung = None  # (worker, problem) found in this poll

    def run(self) -> int:
        while True:
            for handler in (
                self.on_interrupt,
                self.on_chief_exit,
                self.on_hang,
                self.on_worker_deaths,
                self.on_all_workers_exited,
            ):
                status = handler()
                if status is not None:
                    return status
            time.sleep(0.05)

    def on_interrupt(self) -> int | None:
        if not self.interrupt:
            return None
        signum = self.interrupt[0]
        name = signal_name(signum)
        say(f"received {name}: stopping the chief and the tuner workers")
        # SIGTERM, not the signal itself: the processes end without a
        # KeyboardInterrupt traceback each; the oracle was saved after every
        # ended trial, the running ones are trained again on resume.
        self.group.stop(signal.SIGTERM)
        say("interrupted: run the same command again with overwrite=False in the "
            "tuner to resume the search (trials that were running start over)")
        return 128 + signum

    def on_chief_exit(self) -> int | None:
        chief = self.chief
        code = chief.proc.poll()
        if code is None:
            return None
        chief.reader.join(timeout=5)
        if code != 0:
            say(f"the chief {describe_exit(code)}; stopping the tuner workers")
            self.group.stop()
            say(f"last lines of the chief's output:\n{''.join(chief.tail).rstrip()}")
            return exit_status(code)
        # The search is over: workers were told to stop; give them the
        # grace period to exit.
        await_exit(self.workers, self.grace_period)
        self.group.stop()
        deaths = self.deaths
        say(
            f"search finished after {time.monotonic() - self.group.started:.1f}s"
            + (f"; {len(deaths)} tuner worker(s) died: {'; '.join(deaths)}" if deaths else "")
        )
        return 0

    def on_hang(self) -> int | None:
        watched = [self.chief] + [w for w in self.workers if w.label not in self.reported]
        self.hung = self.group.unresponsive(watched)
        if self.hung is None:
            return None
        worker, problem = self.hung
        self.group.report_hang(worker, problem)
        if worker is self.chief:
            say("stopping the search")
            self.group.stop()
            return HANG_EXIT_CODE
        say(f"stopping {worker.label}")
        stop_workers([worker], self.grace_period)
        return None

    def on_worker_deaths(self) -> None:
        for worker in self.workers:
            code = worker.proc.poll()
            if code is None or code == 0 or worker.label in self.reported:
                continue
            self._report_death(worker, code)

    def _report_death(self, worker, code: int) -> None:
        self.reported.add(worker.label)
        worker.reader.join(timeout=2)
        tuner_id = self.group_of[worker.label]
        how = describe_exit(code)
        if self.hung is not None and worker is self.hung[0]:
            how = f"hung ({self.hung[1]}) and was stopped"
        self.deaths.append(f"{worker.label} {how}")
        say(
            f"tuner worker {worker.label} {how}; its trial "
            f"goes back to the oracle once {tuner_id} has been silent for "
            "the tuner's worker_timeout; the search continues with the "
            f"other workers. Last lines of its output:\n"
            f"{''.join(worker.tail).rstrip()}"
        )
        peers = [
            self.by_label[label]
            for label in self.groups[tuner_id]
            if label != worker.label and self.by_label[label].proc.poll() is None
        ]
        if peers:
            say(
                f"stopping the rest of trial group {tuner_id} "
                f"({', '.join(p.label for p in peers)}): they wait in a "
                "collective for the dead worker"
            )
            stop_workers(peers, self.grace_period)
            self.reported.update(p.label for p in peers)

    def on_all_workers_exited(self) -> int | None:
        codes = [w.proc.poll() for w in self.workers]
        if any(c is None for c in codes):
            return None
        if all(c != 0 for c in codes):
            say("every tuner worker has died; stopping the chief")
            self.group.stop()
            return 1
        if self.all_exited_at is None:
            self.all_exited_at = time.monotonic()
        elif time.monotonic() - self.all_exited_at > self.finish_timeout:
            say(
                f"the chief has not finished {self.finish_timeout:g}s after the "
                "last tuner worker exited; stopping it"
            )
            self.group.stop()
            return 1
        return None


def _check(script, num_workers, workers_per_trial, port, log_dir,
           grace_period, finish_timeout, module=False) -> None:
    check_launch_arguments(script, "search", module, grace_period, log_dir)
    check_local_workers("num_workers", num_workers)
    check_count("workers_per_trial", workers_per_trial)
    if num_workers % workers_per_trial:
        raise ValueError(
            "Invalid value for argument `workers_per_trial`: it must divide "
            f"`num_workers` (whole trial groups). Received: num_workers="
            f"{num_workers}, workers_per_trial={workers_per_trial}."
        )
    check_seconds("finish_timeout", finish_timeout)
    if port is not None:
        _cluster.consecutive_ports(port, 1, used_by="the oracle uses")
