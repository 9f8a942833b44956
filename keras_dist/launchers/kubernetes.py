"""Kubernetes: a worker's cluster read inside its pod, and manifests that start one.

Inside a pod of an Indexed Job (or a JobSet) whose pods share a headless
Service, `keras-dist launch --kubernetes --num-workers N` builds the pod's
`TF_CONFIG` from what Kubernetes gives it: its index (`JOB_COMPLETION_INDEX`),
its host name (`<prefix>-<index>`) and its Service's domain (its fully
qualified name, `<prefix>-<index>.<service>.<namespace>.svc...`). Worker i
is `<prefix>-<i>.<domain>:<port + i>`: every pod derives the same list.

`manifests` prints what starts such a job: a headless Service and an
Indexed Job, or a JobSet (`keras-dist manifest kubernetes`).
"""

from __future__ import annotations

import json
import os
import re
import socket

from keras_dist._checks import check_count
from keras_dist._exit_codes import PREEMPTED

INDEX = "JOB_COMPLETION_INDEX"
DEFAULT_PORT = 2222


def pod_cluster(num_workers: int, port: int = DEFAULT_PORT, environ=None,
                hostname: str | None = None, fqdn: str | None = None
                ) -> tuple[list[str], int]:
    """(every worker's address, this pod's rank), read inside the pod.

    Raises:
        ValueError: naming what the pod lacks (`JOB_COMPLETION_INDEX`, an
            indexed host name, a subdomain) and the manifest field that
            gives it.
    """
    environ = os.environ if environ is None else environ
    hostname = socket.gethostname() if hostname is None else hostname
    fqdn = _fqdn(hostname) if fqdn is None else fqdn
    check_count("num_workers", num_workers)
    raw = environ.get(INDEX)
    if raw is None or not raw.isdigit():
        raise ValueError(
            f"Invalid environment for --kubernetes: {INDEX} is "
            f"{'not set' if raw is None else repr(raw)}. Received: {INDEX}="
            f"{raw!r}. Run it in a pod of an Indexed Job (completionMode: "
            "Indexed) or a JobSet, which set it (keras-dist manifest "
            "kubernetes prints one)."
        )
    rank = int(raw)
    if environ.get("JOB_INDEX", "0") != "0":
        raise ValueError(
            "Invalid environment for --kubernetes: JOB_INDEX is "
            f"{environ['JOB_INDEX']!r}: the JobSet has several Jobs in its "
            "replicated job, and their pods are not one numbering. Received: "
            f"JOB_INDEX={environ['JOB_INDEX']!r}. Use replicas: 1 with "
            "parallelism and completions equal to --num-workers."
        )
    if rank >= num_workers:
        raise ValueError(
            f"Invalid value for argument `num_workers`: this pod's {INDEX} is "
            f"{rank}, so the job has more than {num_workers} pods. Received: "
            f"num_workers={num_workers!r}. Pass the Job's completions."
        )
    suffix = f"-{rank}"
    if not hostname.endswith(suffix) or len(hostname) == len(suffix):
        raise ValueError(
            f"Invalid environment for --kubernetes: the pod's host name "
            f"{hostname!r} does not end with -{rank} ({INDEX}). Received: "
            f"hostname={hostname!r}. Indexed Jobs and JobSets name their pods' "
            "hosts <name>-<index>; do not set spec.hostname."
        )
    if not fqdn.startswith(hostname + ".") or len(fqdn) == len(hostname) + 1:
        raise ValueError(
            f"Invalid environment for --kubernetes: the pod's fully qualified "
            f"name {fqdn!r} has no domain, so the other pods cannot be named. "
            f"Received: fqdn={fqdn!r}. Set spec.template.spec.subdomain to "
            "the name of a headless Service that selects the job's pods "
            "(JobSets do it themselves)."
        )
    prefix, domain = hostname[:-len(suffix)], fqdn[len(hostname) + 1:]
    _check_port(port, num_workers)
    return [f"{prefix}-{i}.{domain}:{port + i}" for i in range(num_workers)], rank


def manifests(name: str, image: str, num_workers: int, command: list[str], *,
              port: int = DEFAULT_PORT, gpus_per_worker: int = 0,
              max_restarts: int = 0, backup_claim: str | None = None,
              backup_mount: str = "/backups", kind: str = "job") -> list[dict]:
    """The objects that run `command` (a script and its arguments) as a job.

    `kind="job"`: a headless Service and an Indexed Job; `"jobset"`: one
    JobSet (it makes the Service itself). Every pod runs `keras-dist launch
    --kubernetes --num-workers N --port P`; a pod that exits 42 (a
    BackupAndRestore preemption save) is replaced without counting against
    `max_restarts`; with `backup_claim`, that PersistentVolumeClaim is
    mounted at `backup_mount` on every pod (point `backup_dir` under it).
    """
    _check_name(name)
    if not isinstance(image, str) or not image.strip():
        raise ValueError(f"Invalid value for argument `image`. Expected a container "
                         f"image reference. Received: image={image!r}.")
    check_count("num_workers", num_workers)
    _check_port(port, num_workers)
    check_count("gpus_per_worker", gpus_per_worker, minimum=0)
    check_count("max_restarts", max_restarts, minimum=0)
    if kind not in ("job", "jobset"):
        raise ValueError(f"Invalid value for argument `kind`. Expected 'job' or "
                         f"'jobset'. Received: kind={kind!r}.")
    if backup_claim is not None:
        _check_name(backup_claim, "backup_claim")
    if not isinstance(backup_mount, str) or not backup_mount.startswith("/"):
        raise ValueError(f"Invalid value for argument `backup_mount`. Expected an "
                         f"absolute path. Received: backup_mount={backup_mount!r}.")
    container = {
        "name": "worker",
        "image": image,
        "command": ["keras-dist", "launch", "--kubernetes", "--num-workers",
                    str(num_workers), "--port", str(port), *command[:1], "--",
                    *command[1:]],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"containerPort": port + i, "name": f"worker-{i}"}
                  for i in range(num_workers)],
    }
    if gpus_per_worker:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_worker}}
    pod = {"restartPolicy": "Never", "containers": [container]}
    if backup_claim is not None:
        container["volumeMounts"] = [{"name": "backups", "mountPath": backup_mount}]
        pod["volumes"] = [{"name": "backups",
                           "persistentVolumeClaim": {"claimName": backup_claim}}]
    job_spec = {
        "completionMode": "Indexed",
        "completions": num_workers,
        "parallelism": num_workers,
        # Each restart of the group fails up to every pod once.
        "backoffLimit": max_restarts * num_workers,
        "podFailurePolicy": {"rules": [{
            "action": "Ignore",
            "onExitCodes": {"containerName": "worker", "operator": "In",
                            "values": [PREEMPTED]},
        }]},
        "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}},
                     "spec": pod},
    }
    if kind == "jobset":
        return [{
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": name},
            "spec": {
                "network": {"enableDNSHostnames": True, "subdomain": name,
                            "publishNotReadyAddresses": True},
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [{"name": "workers", "replicas": 1,
                                    "template": {"spec": job_spec}}],
            },
        }]
    pod["subdomain"] = name
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {
                "clusterIP": "None",
                "selector": {"app.kubernetes.io/name": name},
                # Workers look each other up while they start, before ready.
                "publishNotReadyAddresses": True,
            },
        },
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
         "spec": job_spec},
    ]


def _fqdn(hostname: str) -> str:
    """The pod's fully qualified name: Kubernetes writes it first in the
    pod's /etc/hosts line of its host name when the pod has a subdomain."""
    try:
        name = socket.getaddrinfo(hostname, None, flags=socket.AI_CANONNAME)[0][3]
    except OSError:
        name = ""
    return name if name.startswith(hostname + ".") else socket.getfqdn(hostname)


def _check_port(port, num_workers: int) -> None:
    last = 65535 - num_workers + 1
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= last:
        raise ValueError(
            f"Invalid value for argument `port`. Expected an integer from 1024 "
            f"to {last} (worker i listens on port + i). Received: port={port!r}."
        )


def _check_name(name, argument: str = "name") -> None:
    # A DNS label: pod host names are <name>-<index> (JobSet: longer).
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,45}[a-z0-9])?", name):
        raise ValueError(
            f"Invalid value for argument `{argument}`. Expected a lowercase DNS "
            "label of at most 47 characters (letters, digits, '-'; it names "
            f"the pods' hosts). Received: {argument}={name!r}."
        )


def to_yaml(objects: list[dict]) -> str:
    """YAML documents (`---` between them) of plain dicts, lists and scalars."""
    return "---\n".join(_block(o, 0) for o in objects)


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if re.fullmatch(r"[A-Za-z_/][\w./-]*", text) and text.lower() not in (
            "true", "false", "yes", "no", "on", "off", "null", "none", "~"):
        return text
    return json.dumps(text)  # a JSON string is a YAML string


def _block(value, indent: int) -> str:
    pad = " " * indent
    lines = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:\n{_block(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {_inline(item)}")
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    for item in value:
        if isinstance(item, (dict, list)) and item:
            inner = _block(item, indent + 2)
            lines.append(f"{pad}- {inner[indent + 2:]}")
        else:
            lines.append(f"{pad}- {_inline(item)}\n")
    return "".join(lines)


def _inline(value) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)
