"""Runs one subprocess per worker, each with its own TF_CONFIG on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from keras_dist._cluster import loopback_ports


def run_workers(
    script: str,
    args: list[str],
    num_workers: int = 2,
    timeout: float = 300,
    temp_dirs: list[str] | None = None,
    check: bool = True,
    managed: bool = False,
):
    """Runs `script args` on `num_workers` workers; returns their outputs.

    `managed=True`: the `TF_CONFIG` shape of Vertex AI, SageMaker and
    Kubeflow's TFJob instead of `num_workers` workers: a chief, a worker
    and an evaluator (3 processes, in that order).

    `temp_dirs`, if given, become each worker's TMPDIR. Raises
    AssertionError showing every worker's output when any worker fails or
    the job times out. With `check=False` it returns `(exit codes,
    outputs)` instead, stopping the others once one worker has exited with
    an error (as a launcher would): after up to 15 s for an exit code (a
    preempted job exits on every worker), at once for a signal.
    """
    if managed:
        num_workers = 3
        tasks = [("chief", 0), ("worker", 0), ("evaluator", 0)]
    else:
        tasks = [("worker", index) for index in range(num_workers)]
    addresses = [f"127.0.0.1:{p}" for p in loopback_ports(num_workers)]
    cluster = {}
    for (kind, _), address in zip(tasks, addresses):
        cluster.setdefault(kind, []).append(address)
    procs = []
    for index, (kind, task_index) in enumerate(tasks):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": kind, "index": task_index}}
        )
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["PYTHONUNBUFFERED"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
        if temp_dirs:
            os.makedirs(temp_dirs[index], exist_ok=True)
            env["TMPDIR"] = temp_dirs[index]
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs = [""] * num_workers
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                failed = "a worker exited with an error"
                if not check and not any(c is not None and c < 0 for c in codes):
                    # Give the others a moment to finish on their own (a
                    # preempted job exits on every worker), then stop them.
                    # A worker killed by a signal (SIGKILL) leaves its peers
                    # waiting in a collective that cannot finish: they are
                    # stopped at once (measured: they waited out all 15 s).
                    grace = time.monotonic() + 15
                    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                        time.sleep(0.2)
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout}s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for i, p in enumerate(procs):
            outputs[i] = p.communicate()[0]
    if not check and failed != f"timed out after {timeout}s":
        return [p.returncode for p in procs], outputs
    if failed:
        shown = "\n".join(
            f"----- worker {i} (exit {p.returncode}) -----\n{out[-6000:]}"
            for i, (p, out) in enumerate(zip(procs, outputs))
        )
        raise AssertionError(f"multi-worker job failed: {failed}\n{shown}")
    return outputs


def children(pid):
    """The live (not zombie) child processes of `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX":
            found.append(int(entry))
    return found


def workers_of(launcher):
    """The live worker processes of a launcher: its children, or, for a local
    job in its own network namespace (the default), those of the launcher
    it runs inside the namespace."""
    found = []
    for pid in children(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                inner = b"keras_dist.cli" in f.read()
        except OSError:
            continue
        found += workers_of(pid) if inner else [pid]
    return found
