"""The cluster of a multi-worker job: read, checked and built in one place.

Reading: `TF_CONFIG` (or Slurm's environment) is read and checked here,
before any collective starts, so that a typo in a hand-written cluster spec
fails with a message naming the field instead of hanging every worker in a
collective (`parse_tf_config`, `ClusterInfo`). Building: the launchers'
`TF_CONFIG` for each worker, local (free loopback ports), multi-host
(`--hosts`) or Slurm (`tf_config`, `parse_hosts`, `slurm_cluster`).
`keras_dist.worker_info` gives a strategy's view of the same cluster.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

_VALID_TASK_TYPES = ("chief", "worker", "evaluator", "ps")


@dataclass(frozen=True)
class ClusterInfo:
    """What `TF_CONFIG` says about the job and this process's place in it."""

    cluster: dict
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        """Tasks that train: chief plus workers."""
        return len(self.cluster.get("chief", [])) + len(
            self.cluster.get("worker", [])
        )

    @property
    def rank(self) -> int:
        """This task's position among the training tasks (chief first)."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return len(self.cluster.get("chief", [])) + self.task_index
        return -1

    @property
    def is_chief(self) -> bool:
        if self.task_type == "chief":
            return True
        return (
            self.task_type == "worker"
            and self.task_index == 0
            and "chief" not in self.cluster
        )


def _fail(field: str, received, fix: str) -> ValueError:
    return ValueError(
        f"Invalid `TF_CONFIG` environment variable: bad field `{field}`. "
        f"Received: {field}={received!r}. {fix}"
    )


def parse_tf_config(raw: str | None = None) -> ClusterInfo | None:
    """Parses and validates `TF_CONFIG`; returns None when it is unset/empty.

    Raises:
        ValueError: naming `TF_CONFIG`, the bad field and the received value.
    """
    if raw is None:
        raw = os.environ.get("TF_CONFIG", "")
    if not raw.strip():
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            "Invalid `TF_CONFIG` environment variable: it is not valid JSON "
            f"({e.msg} at position {e.pos}). Received: TF_CONFIG={raw!r}. "
            'Expected e.g. {"cluster": {"worker": ["127.0.0.1:20000", '
            '"127.0.0.1:20001"]}, "task": {"type": "worker", "index": 0}}.'
        ) from None
    if not isinstance(config, dict):
        raise _fail("TF_CONFIG", config, "Expected a JSON object.")
    cluster = _checked_cluster(config.get("cluster"))
    task_type, task_index = _checked_task(config.get("task"), cluster)
    return ClusterInfo(cluster=cluster, task_type=task_type, task_index=task_index)


def _checked_cluster(cluster) -> dict:
    """`TF_CONFIG`'s `cluster`: known task types, host:port lists, no address twice."""
    if not isinstance(cluster, dict) or not cluster:
        raise _fail(
            "cluster",
            cluster,
            'Expected a non-empty object mapping task types to address '
            'lists, e.g. {"worker": ["127.0.0.1:20000"]}.',
        )
    for task_type, addresses in cluster.items():
        if task_type not in _VALID_TASK_TYPES:
            raise _fail(
                f"cluster.{task_type}",
                addresses,
                f"Task types must be one of {_VALID_TASK_TYPES}.",
            )
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and ":" in a for a in addresses)
        ):
            raise _fail(
                f"cluster.{task_type}",
                addresses,
                'Expected a non-empty list of "host:port" strings.',
            )
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise _fail(
                    f"cluster.{task_type}",
                    addresses,
                    f"Address {address!r} is not host:port with a port in "
                    "1-65535 (digits only).",
                )
    seen = {}
    for task_type, addresses in cluster.items():
        for address in addresses:
            if address in seen:
                raise _fail(
                    f"cluster.{task_type}",
                    addresses,
                    f"Address {address!r} appears twice (also in cluster."
                    f"{seen[address]}): every task needs its own host:port.",
                )
            seen[address] = task_type
    if len(cluster.get("chief", [])) > 1:
        raise _fail(
            "cluster.chief", cluster["chief"], "A job has at most one chief."
        )
    return cluster


def _checked_task(task, cluster: dict) -> tuple[str, int]:
    """`TF_CONFIG`'s `task`: a type of `cluster` and an index within it."""
    if not isinstance(task, dict):
        raise _fail(
            "task",
            task,
            'Expected an object such as {"type": "worker", "index": 0}.',
        )
    task_type = task.get("type")
    if task_type not in cluster:
        raise _fail(
            "task.type",
            task_type,
            f"It must name a task type present in `cluster`: "
            f"{sorted(cluster)}.",
        )
    task_index = task.get("index", 0)
    if (
        not isinstance(task_index, int)
        or isinstance(task_index, bool)
        or not 0 <= task_index < len(cluster[task_type])
    ):
        raise _fail(
            "task.index",
            task_index,
            f"Expected an integer in [0, {len(cluster[task_type])}) for task "
            f"type {task_type!r}.",
        )
    return task_type, task_index


def slurm_num_tasks() -> int:
    """Number of tasks of the enclosing Slurm job step (1 outside Slurm)."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def slurm_num_nodes() -> int:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


# -- building the TF_CONFIG of each worker (the launchers) -----------------------

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


def consecutive_ports(first, count: int, used_by: str = "the workers use") -> list[int]:
    """`first`, `first + 1`, ... on 127.0.0.1, each checked free now.

    Raises:
        ValueError: naming `port`, for a bad number or a port in use.
    """
    last = 65535 - count + 1
    which = (f"port, port + 1, ..., port + {count - 1}" if count > 1 else "that port")
    if not isinstance(first, int) or isinstance(first, bool) or not 1024 <= first <= last:
        raise ValueError(
            f"Invalid value for argument `port`. Expected an integer from 1024 "
            f"to {last} ({used_by} {which}). Received: port={first!r}."
        )
    ports = list(range(first, first + count))
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                needed = f"ports {ports[0]}-{ports[-1]}" if count > 1 else "it"
                raise ValueError(
                    f"Invalid value for argument `port`: 127.0.0.1:{port} is "
                    f"in use ({used_by} {needed}). Received: port={first!r}. "
                    "Choose another port, or leave it out for a free one "
                    "chosen by the system."
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
        # As TensorFlow's gRPC server binds: a port whose last connections
        # wait out TIME_WAIT (a worker that just exited) is free for it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
