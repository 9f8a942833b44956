"""`launch`: start and supervise the workers of a multi-worker job."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from keras_dist import _cluster, _liveness, _netns
from keras_dist._checks import (
    check_count,
    check_launch_arguments,
    check_local_workers,
    check_seconds,
)
from keras_dist.launchers import elastic_policy as policy
from keras_dist.launchers import gpus, kubernetes
from keras_dist.launchers.config import LaunchConfig
from keras_dist.launchers.rendezvous import ElasticHost
from keras_dist.launchers.supervisor import (
    PORT_RETRIES,
    Group,
    forwarded_signals,
    python_command,
    say,
)


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
    private_network: bool | None = None,
    min_workers: int | None = None,
    rejoin_after: float = 60.0,
    rendezvous: str | None = None,
    gpus_per_worker: int | None = None,
    kubernetes: bool = False,
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

    Elastic local jobs (`min_workers=K`, K <= N): a job that backs itself up
    with `keras_dist.callbacks.BackupAndRestore` keeps running on fewer
    workers instead of failing. When a worker fails and the restarts are
    used up, or a worker is preempted (exit 42: it saved), the job goes on
    from the last backup with one worker fewer, down to K; after
    `rejoin_after` seconds of training on fewer than N workers (counted
    from the group's first step), the launcher asks the group to save and
    exit (SIGTERM) and starts N workers again. The
    backup resumes on any number of workers at the same global batch, so
    the run is the one an uninterrupted job gives (see docs/elastic.md).
    Every change of size is logged with its reason. On several hosts
    (`hosts`, `rank`, `min_workers` and `rendezvous` on every host) the
    launchers agree through the rendezvous directory: lost hosts are left
    out, hosts that come back rejoin (see `keras_dist.launchers.rendezvous`).

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
        private_network: True, False or None (the default). TensorFlow's
            servers listen on every interface (it has no setting for that).
            A local job runs in its own network namespace, whose only
            interface is a private loopback: nothing outside can reach its
            workers, and the workers cannot reach the network. None: local
            jobs get one where the machine can make one (Linux, `unshare`),
            and the console says which; True: required (an error where it
            cannot be made, or for a multi-host job); False: the workers
            keep this host's network and can be reached from it.
        min_workers: Positive integer <= the job's workers, default None
            (no resizing): the fewest workers the job may continue on.
            Local mode, or multi-host mode with `rendezvous`.
        rejoin_after: Positive number of seconds, default 60: how long a
            job with `min_workers` trains on fewer than `num_workers`
            workers before it grows back (multi-host: how old a generation
            is before a host that came back joins, and how long the first
            generation waits for every host).
        rendezvous: Multi-host elastic jobs (`hosts`, `rank` and
            `min_workers`): where the launchers agree on which hosts run:
            a directory on storage every host sees, or
            `etcd://host:port/prefix`, a key prefix of this job's own in an
            etcd cluster (see `keras_dist.launchers.rendezvous`).
        gpus_per_worker: Non-negative integer or None (the default): the
            GPUs each worker started on this host gets, through its own
            `CUDA_VISIBLE_DEVICES` (0: none, the workers train on the
            CPUs). None: this host's GPUs split evenly over its workers (a
            host with 8 GPUs and 4 workers: 2 each); a host without GPUs
            changes nothing. The GPUs handed out are those the launcher's
            own `CUDA_VISIBLE_DEVICES` lists, else every NVIDIA device of
            the host. A split that cannot give every worker the same
            number of GPUs of its own is refused before any worker starts
            (see `keras_dist.launchers.gpus`).
        kubernetes: Boolean, default False: this launcher runs in one pod
            of an Indexed Job or JobSet of `num_workers` pods and starts
            that pod's worker, whose cluster it reads from the pod
            (`JOB_COMPLETION_INDEX`, the pod's host name and its headless
            Service's domain; worker i listens on `port + i`, default
            2222). See `keras_dist.launchers.kubernetes` and
            `keras-dist manifest kubernetes`.

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
    return run(LaunchConfig(
        script, tuple(script_args), num_workers=num_workers, hosts=hosts, rank=rank,
        max_restarts=max_restarts, log_dir=log_dir, grace_period=grace_period,
        module=module, port=port, verbose=verbose, start_timeout=start_timeout,
        hang_timeout=hang_timeout, private_network=private_network,
        min_workers=min_workers, rejoin_after=rejoin_after, rendezvous=rendezvous,
        gpus_per_worker=gpus_per_worker, kubernetes=kubernetes,
    ))


def run(config: LaunchConfig) -> int:
    """Checks `config` before anything starts, then runs the job (`launch`)."""
    configs_for = _plan(config)
    gpu_env = _gpu_environment(config)
    _check_elastic(config)
    timeouts = _liveness.Timeouts.checked(config.start_timeout, config.hang_timeout)
    if _netns.wanted(config.private_network, local=config.local,
                     received=f"hosts={config.hosts!r}"):
        return _netns.run_inside(config.command_line(private_network=False))
    _netns.set_up_if_inside()
    if config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
    command = python_command(config.script, config.script_args, config.module)
    say(_netns.exposure(local=config.local,
                        private_network=config.private_network))
    if gpu_env.plan is not None:
        say(gpu_env.plan.describe(config.num_workers if config.local else 1))
    if config.rendezvous is not None:
        host = ElasticHost(
            command, _cluster.parse_hosts(config.hosts), config.rank,
            os.fspath(config.rendezvous), min_workers=config.min_workers,
            rejoin_after=config.rejoin_after, max_restarts=config.max_restarts,
            log_dir=config.log_dir, grace_period=config.grace_period,
            verbose=config.verbose, timeouts=timeouts, worker_env=gpu_env(0),
        )
        with forwarded_signals() as interrupt:
            return host.run(interrupt)
    job = _Job(
        command,
        configs_for,
        log_dir=config.log_dir,
        grace_period=config.grace_period,
        verbose=config.verbose,
        timeouts=timeouts,
        max_restarts=config.max_restarts,
        # Fresh ports can be drawn only for a local job on launcher-chosen ports.
        redraw_ports=config.local and config.port is None,
        size=config.num_workers if config.local else None,
        min_workers=config.min_workers,
        rejoin_after=config.rejoin_after,
        worker_env=gpu_env,
    )
    with forwarded_signals() as interrupt:
        return job.run(interrupt)


class _GpuEnvironment:
    """Worker `rank`'s GPU variables (`gpus.GpuPlan`); none without a plan."""

    def __init__(self, plan: gpus.GpuPlan | None, local: bool):
        self.plan = plan
        self.local = local

    def __call__(self, rank: int) -> dict[str, str]:
        if self.plan is None:
            return {}
        # A multi-host or Slurm launcher starts one worker: its host's first share.
        return self.plan.environment(rank if self.local else 0)


def _gpu_environment(config: LaunchConfig) -> _GpuEnvironment:
    """The GPUs of each worker this launcher starts, checked before any starts.

    Local jobs split this host's GPUs (or `gpus_per_worker` each); a
    multi-host or Slurm launcher starts one worker, which keeps the GPUs
    it was given unless `gpus_per_worker` asks for fewer.
    """
    local = config.local
    if not local and config.gpus_per_worker is None:
        return _GpuEnvironment(None, local)
    plan = gpus.plan(gpus.visible_gpus(), config.num_workers if local else 1,
                     config.gpus_per_worker)
    return _GpuEnvironment(plan, local)


class _Job:
    """Runs the worker group until it succeeds, is interrupted or runs out
    of restarts; one handler per outcome, the decisions are
    `elastic_policy`'s. An elastic job (`min_workers`) also changes the
    group's size: `size` workers now, `terms.hosts` wanted."""

    def __init__(self, command, configs_for, *, log_dir, grace_period, verbose,
                 timeouts, max_restarts, redraw_ports, size=None, min_workers=None,
                 rejoin_after=60.0, worker_env=lambda rank: {}):
        self.command = command
        self.worker_env = worker_env
        self.configs_for = configs_for
        self.log_dir = log_dir
        self.grace_period = grace_period
        self.verbose = verbose
        self.timeouts = timeouts
        self.redraw_ports = redraw_ports
        self.size = size
        self.elastic = min_workers is not None
        # The job's terms, as the multi-host leader's policy reads them.
        self.terms = policy.Job(hosts=size or 0, min_workers=min_workers or 1,
                                max_restarts=max_restarts, rejoin_after=rejoin_after)
        self.restarts = 0
        self.resizes = 0
        self.port_retries = 0
        self.started = time.monotonic()

    def run(self, interrupt) -> int:
        while True:
            configs = self.configs_for(self.size)
            resize_after = policy.resize_after(self.terms, self.size, self.elastic)
            outcome = self._start(configs).wait(interrupt, resize_after)
            for handler in (self._on_port_conflict, self._on_success, self._on_regrow,
                            self._on_failure):
                status = handler(outcome, configs)  # an exit status, "retry" or None
                if status is not None:
                    break
            if status != "retry":
                return status

    def _start(self, configs) -> Group:
        processes = [(f"worker {r}", {"TF_CONFIG": c, **self.worker_env(r)})
                     for r, c in configs]
        say(
            ("restart: " if self.restarts or self.port_retries or self.resizes else "")
            + f"starting {_describe_workers(configs)}: python "
            + " ".join(self.command)
            + (f" (output in {self.log_dir}/worker-<rank>.log)" if self.log_dir else "")
        )
        return Group(self.command, processes, self.log_dir, self.grace_period,
                     self.verbose, timeouts=self.timeouts, hold_tracebacks=True)

    def _carry_out(self, decision: policy.LocalDecision, code: int):
        if decision.action == "resize":
            say(f"resize: {self.size} -> {decision.size} workers because {decision.reason}")
            self.size = decision.size
            self.resizes += 1
            return "retry"
        if decision.action == "restart":
            self.restarts = decision.restarts
            say(f"restarting the worker group ({self.restarts}/{self.terms.max_restarts}) "
                f"because {decision.reason}")
            return "retry"
        say(f"job failed: {decision.reason}")
        return code

    def _on_port_conflict(self, outcome, configs):
        if not (outcome.port_conflict and self.redraw_ports
                and self.port_retries < PORT_RETRIES):
            return None
        self.port_retries += 1
        say(
            "a worker could not bind its port (taken by another process); "
            f"retrying with fresh ports ({self.port_retries}/{PORT_RETRIES})"
        )
        return "retry"

    def _on_success(self, outcome, configs):
        if outcome.code != 0:
            return None
        say(
            f"job finished: {len(configs)} worker(s) exited with code 0 "
            f"after {time.monotonic() - self.started:.1f}s"
            + (f" and {self.restarts} restart(s)" if self.restarts else "")
            + (f" and {self.resizes} resize(s)" if self.resizes else "")
        )
        return 0

    def _on_regrow(self, outcome, configs):
        if not outcome.stopped_to_resize:
            return None
        return self._carry_out(policy.after_a_local_stop_to_grow(
            self.terms, self.restarts, outcome.code, outcome.reason), outcome.code)

    def _on_failure(self, outcome, configs):
        if outcome.interrupted:
            return outcome.code
        return self._carry_out(policy.after_a_local_failure(
            self.terms, self.size, self.restarts, outcome.code, outcome.reason,
            self.elastic), outcome.code)


def _check_elastic(config: LaunchConfig) -> None:
    min_workers, num_workers = config.min_workers, config.num_workers
    hosts, rendezvous = config.hosts, config.rendezvous
    check_seconds("rejoin_after", config.rejoin_after)
    if min_workers is None:
        if rendezvous is not None:
            raise ValueError(
                "Argument `rendezvous` belongs to elastic multi-host jobs. "
                f"Received: rendezvous={rendezvous!r} without min_workers. Pass "
                "min_workers=K (--min-workers K) too, or leave rendezvous out."
            )
        return
    check_count("min_workers", min_workers)
    if num_workers is None and hosts is None:
        raise ValueError(
            "Argument `min_workers` needs num_workers=N (local) or hosts with "
            f"rendezvous (multi-host). Received: min_workers={min_workers!r}. "
            "Inside Slurm, resume on another allocation size by starting the "
            "job again (docs/elastic.md)."
        )
    if hosts is not None and rendezvous is None:
        raise ValueError(
            "Argument `rendezvous` is required for an elastic multi-host job: "
            "a directory every host sees, where the launchers agree on who "
            f"runs. Received: min_workers={min_workers!r}, hosts={hosts!r}, "
            "rendezvous=None. Pass rendezvous=DIR (--rendezvous DIR) on every "
            "host, e.g. next to the backups."
        )
    if num_workers is not None and rendezvous is not None:
        raise ValueError(
            "Argument `rendezvous` applies to multi-host jobs (hosts=...). "
            f"Received: rendezvous={rendezvous!r}, num_workers={num_workers!r}. "
            "A local elastic job needs only min_workers."
        )
    size = num_workers if num_workers is not None else len(_cluster.parse_hosts(hosts))
    if min_workers > size:
        raise ValueError(
            "Invalid value for argument `min_workers`. Expected at most "
            f"{size} (the workers of the job). Received: min_workers={min_workers!r}."
        )


def _describe_workers(configs) -> str:
    """'2 workers (127.0.0.1:5001, 127.0.0.1:5002)' or 'worker 1 of 2 (...)'."""
    cluster = json.loads(configs[0][1])["cluster"]["worker"]
    if len(configs) == len(cluster):
        return f"{len(cluster)} worker(s) ({', '.join(cluster)})"
    rank = configs[0][0]
    return f"worker {rank} of {len(cluster)} ({cluster[rank]})"


def _plan(config: LaunchConfig):
    """Validates the cluster options up front; returns a TF_CONFIG factory."""
    num_workers, hosts, rank, port = config.num_workers, config.hosts, config.rank, config.port
    check_launch_arguments(config.script, "training", config.module, config.grace_period,
                           config.log_dir)
    check_count("max_restarts", config.max_restarts, minimum=0)
    if num_workers is not None and hosts is not None:
        raise ValueError(
            "Arguments `num_workers` and `hosts` are mutually exclusive. "
            f"Received: num_workers={num_workers!r}, hosts={hosts!r}. Use "
            "num_workers for local workers, hosts (with rank) for one host "
            "of a multi-host job."
        )
    if config.kubernetes:
        if num_workers is None or hosts is not None:
            raise ValueError(
                "Argument `kubernetes` needs num_workers=N (the Job's "
                "completions) and no hosts: the pods' names come from the "
                f"pod. Received: kubernetes=True, num_workers={num_workers!r}, "
                f"hosts={hosts!r}."
            )
        if config.min_workers is not None:
            raise ValueError(
                "Argument `min_workers` does not apply with kubernetes=True: "
                "Kubernetes replaces a failed or preempted pod itself (the "
                "Job's podFailurePolicy and backoffLimit). Received: "
                f"min_workers={config.min_workers!r}, kubernetes=True. Leave "
                "min_workers out; BackupAndRestore resumes the job on the new pods."
            )
        workers, pod_rank = kubernetes.pod_cluster(
            num_workers, kubernetes.DEFAULT_PORT if port is None else port)
        config = _cluster.tf_config(workers, pod_rank)
        return lambda size=None: [(pod_rank, config)]
    if num_workers is not None:
        check_local_workers("num_workers", num_workers)

        if port is not None:
            fixed = _cluster.consecutive_ports(port, num_workers)

        def local(size=num_workers):
            ports = (fixed[:size] if port is not None
                     else _cluster.loopback_ports(size))
            workers = [f"127.0.0.1:{p}" for p in ports]
            return [(r, _cluster.tf_config(workers, r)) for r in range(size)]

        return local
    if port is not None:
        raise ValueError(
            "Argument `port` applies to local workers (num_workers=N) only. "
            f"Received: port={port!r}, hosts={hosts!r}. With hosts, each "
            "entry names its port (host:port)."
        )
    if hosts is not None:
        workers = _cluster.parse_hosts(hosts)
        if rank is None:
            raise ValueError(
                "Argument `rank` is required with `hosts`: the index of this "
                f"host in the list. Received: rank=None, hosts={hosts!r}."
            )
        _cluster.check_rank(rank, len(workers))
        _cluster.check_port_free(workers[rank])
        config = _cluster.tf_config(workers, rank)
        return lambda size=None: [(rank, config)]
    slurm = _cluster.slurm_cluster()
    if slurm is not None:
        workers, slurm_rank = slurm
        config = _cluster.tf_config(workers, slurm_rank)
        return lambda size=None: [(slurm_rank, config)]
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
        workers = _cluster.parse_hosts(hosts)
    elif num_workers is not None:
        check_local_workers("num_workers", num_workers)
        workers = [f"127.0.0.1:{p}" for p in _cluster.loopback_ports(num_workers)]
    else:
        slurm = _cluster.slurm_cluster()
        if slurm is None:
            raise ValueError(
                "Pass --num-workers N or --hosts h1:port,h2:port with "
                f"--print-tf-config. Received: num_workers={num_workers!r}, "
                f"hosts={hosts!r}."
            )
        workers = slurm[0]
    return [_cluster.tf_config(workers, r) for r in range(len(workers))]
