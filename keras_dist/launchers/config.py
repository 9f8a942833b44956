"""`LaunchConfig`: every option of `keras-dist launch` / `keras_dist.launch`
in one object, checked once, written back as a command line once.

`launch()` and the `keras-dist launch` command both make one; the launcher
then reads it (`launchers/train.py`). A job run in its own network namespace
(`private_network=True`) starts `keras-dist launch` again inside it with
`command_line()`, which the command reads back to the same config
(`from_cli`; tests/test_launcher.py checks the round trip of every option).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    script: str
    script_args: tuple[str, ...] = ()
    num_workers: int | None = None
    hosts: str | None = None
    rank: int | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    grace_period: float = 5.0
    module: bool = False
    port: int | None = None
    verbose: bool = False
    start_timeout: float | None = 300.0
    hang_timeout: float | None = 900.0
    private_network: bool | None = None  # None: private where it can be made
    min_workers: int | None = None
    rejoin_after: float = 60.0
    rendezvous: str | None = None
    gpus_per_worker: int | None = None  # None: this host's GPUs split evenly
    kubernetes: bool = False  # one worker per pod, cluster read in the pod

    @property
    def local(self) -> bool:
        """Every worker on this machine (`num_workers` without `kubernetes`)."""
        return self.num_workers is not None and not self.kubernetes

    def command_line(self, private_network: bool | None = None) -> list[str]:
        """The `keras-dist launch` arguments that make this config.

        `private_network`: override the flag (the launcher started inside
        the namespace leaves it out: it is already there).
        """
        args = ["launch"]
        for field in dataclasses.fields(self):
            name = field.name
            value = getattr(self, name)
            if name in ("script", "script_args"):
                continue
            if name == "private_network" and private_network is not None:
                value = private_network
            flag = "--" + name.replace("_", "-")
            if name == "private_network":
                if value is not None:
                    args.append(flag if value else "--no-private-network")
            elif isinstance(value, bool):
                if value:
                    args.append(flag)
            elif name in ("start_timeout", "hang_timeout"):
                args += [flag, repr(float(value or 0))]  # 0: no limit
            elif value is not None:
                args += [flag, _text(value)]
        return [*args, os.fspath(self.script), "--", *self.script_args]

    @classmethod
    def from_cli(cls, args, script_args) -> LaunchConfig:
        """The config of a parsed `keras-dist launch` command line."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("script", "script_args")}
        values["start_timeout"] = values["start_timeout"] or None
        values["hang_timeout"] = values["hang_timeout"] or None
        return cls(args.script, tuple(script_args), **values)


def _text(value) -> str:
    if isinstance(value, float):
        return repr(value)  # every digit: the same float read back
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)
