"""Reading and validating the cluster description of a multi-worker job.

`TF_CONFIG` is read and checked here, before any collective starts, so that a
typo in a hand-written cluster spec fails with a message naming the field
instead of hanging every worker in a collective.
"""

from __future__ import annotations

import json
import os
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
    cluster = config.get("cluster")
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
    task = config.get("task")
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
    return ClusterInfo(cluster=cluster, task_type=task_type, task_index=task_index)


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
