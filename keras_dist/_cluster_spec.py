"""Building the `TF_CONFIG` of each worker: local, multi-host and Slurm."""

from __future__ import annotations

import json
import os
import socket

# Set by `keras-dist launch` / `keras-dist tune` in the processes they start:
# keras_dist then prints "[keras-dist] ..." progress lines for the console.
LAUNCHED_ENV = "KERAS_DIST_LAUNCHED"


def loopback_ports(count: int) -> list[int]:
    """Distinct free ports on 127.0.0.1, chosen by the kernel.

    All sockets stay bound until every port is chosen (no duplicates); they
    are released just before the workers start, because TensorFlow's gRPC
    server refuses to share a port.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def consecutive_ports(first, count: int) -> list[int]:
    """`first`, `first + 1`, ... on 127.0.0.1, each checked free now.

    Raises:
        ValueError: naming `port`, for a bad number or a port in use.
    """
    if (
        not isinstance(first, int)
        or isinstance(first, bool)
        or not 1024 <= first <= 65535 - count + 1
    ):
        raise ValueError(
            "Invalid value for argument `port`. Expected an integer from 1024 "
            f"to {65535 - count + 1} (the workers use port, port + 1, ..., "
            f"port + {count - 1}). Received: port={first!r}."
        )
    ports = list(range(first, first + count))
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ValueError(
                    f"Invalid value for argument `port`: 127.0.0.1:{port} is "
                    f"in use (the workers need ports {ports[0]}-{ports[-1]}). "
                    f"Received: port={first!r}. Choose another port, or "
                    "leave it out for free ports chosen by the system."
                ) from None
    return ports


def tf_config(workers: list[str], index: int) -> str:
    return json.dumps(
        {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}
    )


def parse_hosts(hosts: str) -> list[str]:
    """Parses `host1:port,host2:port`.

    Raises:
        ValueError: naming `--hosts`, the bad entry and the expected form.
    """
    if not isinstance(hosts, str) or not hosts.strip():
        raise ValueError(
            "Invalid value for argument `--hosts`. Expected a comma-separated "
            f"list of host:port. Received: --hosts={hosts!r}."
        )
    entries = [h.strip() for h in hosts.split(",")]
    seen = set()
    for entry in entries:
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                "Invalid value for argument `--hosts`: entry "
                f"{entry!r} is not host:port with a port in 1-65535. "
                f"Received: --hosts={hosts!r}. Example: "
                "--hosts node1:20000,node2:20000."
            )
        if entry in seen:
            raise ValueError(
                f"Invalid value for argument `--hosts`: {entry!r} appears twice. "
                f"Received: --hosts={hosts!r}. Each worker needs its own host:port."
            )
        seen.add(entry)
    return entries


def check_rank(rank, num_workers: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < num_workers:
        raise ValueError(
            "Invalid value for argument `--rank`. Expected an integer in "
            f"[0, {num_workers}) for {num_workers} hosts. Received: --rank={rank!r}."
        )
    return rank


def check_port_free(address: str) -> None:
    """Raises if `address` is on this machine and its port is taken."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except socket.gaierror:
        return  # not resolvable here: another host's problem
    local = {"127.0.0.1", "0.0.0.0"}
    try:
        local.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    if not any(info[4][0] in local or info[4][0].startswith("127.") for info in infos):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", int(port)))
        except OSError as e:
            raise ValueError(
                f"Port {port} of this host's worker address {address!r} is "
                f"already in use ({e.strerror}). Pick a free port in --hosts, "
                "or stop the process holding it."
            ) from None


def slurm_cluster() -> tuple[list[str], int] | None:
    """Workers and this task's rank from Slurm's variables, or None.

    Uses TensorFlow's `SlurmClusterResolver` (one worker per Slurm task,
    ports from 8888 upward per node), as `MultiWorkerMirroredStrategy`
    would inside the same allocation.
    """
    if "SLURM_PROCID" not in os.environ or "SLURM_STEP_NODELIST" not in os.environ:
        return None
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        jobs={"worker": int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))}
    )
    spec = resolver.cluster_spec().as_dict()
    workers = spec["worker"]
    if isinstance(workers, dict):
        workers = [workers[i] for i in sorted(workers)]
    return list(workers), int(resolver.task_id)
