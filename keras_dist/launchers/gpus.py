"""Which GPUs each local worker of a `keras-dist launch` job gets.

Two TensorFlow processes that see the same GPU each reserve most of its
memory and the second one fails (or both crawl): every local worker gets
GPUs of its own through `CUDA_VISIBLE_DEVICES`, and a split that cannot
give each worker the same number is refused before any worker starts
(`MultiWorkerMirroredStrategy` needs the same replicas on every worker).

Read without TensorFlow (the launcher never imports it): the GPUs this
launcher may hand out are the ones its own `CUDA_VISIBLE_DEVICES` lists
when it is set (a scheduler such as Slurm or Kubernetes set it, or the
user), else the NVIDIA devices of this host (`/dev/nvidia<N>`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from keras_dist._checks import check_count

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus(environ=None, dev: str = "/dev") -> list[str]:
    """The GPUs this process may hand out, as `CUDA_VISIBLE_DEVICES` names them.

    `CUDA_VISIBLE_DEVICES` when set: its entries up to the first that CUDA
    would stop at (empty, or a negative index such as the common `-1`,
    which hides every GPU); indices and `GPU-<uuid>`/`MIG-<uuid>` names are
    kept as written. Unset: `"0"`, `"1"`, ... for each `/dev/nvidia<N>`.
    """
    environ = os.environ if environ is None else environ
    if VISIBLE in environ:
        names = []
        for entry in environ[VISIBLE].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            names.append(entry)
        return names
    try:
        devices = [d for d in os.listdir(dev) if re.fullmatch(r"nvidia\d+", d)]
    except OSError:
        return []
    return [str(i) for i in range(len(devices))]


@dataclass(frozen=True)
class GpuPlan:
    """`per_worker` GPUs for each worker, taken in order from `gpus`."""

    gpus: tuple[str, ...]
    per_worker: int

    def environment(self, rank: int) -> dict[str, str]:
        """Worker `rank`'s `CUDA_VISIBLE_DEVICES` ("" hides every GPU)."""
        chosen = self.gpus[rank * self.per_worker:(rank + 1) * self.per_worker]
        return {VISIBLE: ",".join(chosen)}

    def describe(self, num_workers: int) -> str:
        """The console's line: which worker has which GPUs, and the idle ones."""
        if self.per_worker == 0:
            return (f"GPUs: none for the workers (--gpus-per-worker 0; "
                    f"{len(self.gpus)} on this host): they train on the CPUs")
        parts = [f"worker {r} {self.environment(r)[VISIBLE]}" for r in range(num_workers)]
        idle = len(self.gpus) - self.per_worker * num_workers
        return (f"GPUs ({VISIBLE}): " + "; ".join(parts)
                + (f"; {idle} of {len(self.gpus)} idle" if idle else ""))


def plan(gpus, num_workers: int, gpus_per_worker: int | None = None) -> GpuPlan | None:
    """Each local worker's GPUs, or None where there is nothing to hand out.

    Args:
        gpus: The GPUs the launcher may hand out (`visible_gpus()`).
        num_workers: Workers started on this host.
        gpus_per_worker: GPUs each worker gets; None (the default): all of
            them split evenly, `len(gpus) / num_workers`; 0: none (the
            workers train on the CPUs).

    Raises:
        ValueError: naming `gpus_per_worker` (or `num_workers`) and what
            this host has, when the workers cannot each get their own GPUs.
    """
    gpus = tuple(gpus)
    count = len(gpus)
    listed = f" ({VISIBLE}={','.join(gpus)})" if count else ""
    if gpus_per_worker is not None:
        check_count("gpus_per_worker", gpus_per_worker, minimum=0)
        if gpus_per_worker * num_workers > count:
            raise ValueError(
                f"Invalid value for argument `gpus_per_worker`: {num_workers} "
                f"worker(s) x {gpus_per_worker} GPU(s) need "
                f"{gpus_per_worker * num_workers}; this host has {count}"
                f"{listed}. Received: gpus_per_worker={gpus_per_worker!r}, "
                f"num_workers={num_workers!r}. "
                + (f"Pass gpus_per_worker={count // num_workers} or less (0: "
                   "train on the CPUs), or start fewer workers."
                   if count >= num_workers else
                   f"Pass gpus_per_worker=0 to train on the CPUs, or start at "
                   f"most {count} worker(s).")
            )
        return GpuPlan(gpus, gpus_per_worker)
    if count == 0:
        return None
    if count % num_workers:
        if count < num_workers:
            why = ("each worker needs a GPU of its own (two TensorFlow "
                   "processes on one GPU each reserve its memory)")
            start = f"Start at most {count} worker(s)"
        else:
            why = ("every worker needs the same number of GPUs (the same "
                   "replicas on every worker)")
            start = f"Start a number of workers that divides {count}"
        raise ValueError(
            f"Invalid value for argument `num_workers`: {num_workers} workers "
            f"cannot share this host's {count} GPU(s){listed}: {why}. "
            f"Received: num_workers={num_workers!r}. {start} (one worker "
            "uses all of its GPUs as replicas), pass gpus_per_worker=K to "
            "give each worker K and leave the rest idle, or "
            "gpus_per_worker=0 to train on the CPUs."
        )
    return GpuPlan(gpus, count // num_workers)
