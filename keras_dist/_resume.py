"""What resuming from a backup means for one `fit`: the `ResumePlan`.

`BackupAndRestore` chooses and verifies a backup (`_backup_store`), reads
its variables, and turns its recorded position into a plan: the epoch the
fit starts at, the train-function calls that skip the batches already
trained, the input iterator to position, and the states to apply when that
epoch begins (callbacks, metrics' running means). The checks that a backup
fits the model and the fit are here too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass
class ResumePlan:
    state: dict  # the backup's state.json
    directory: str  # the backup's directory
    epoch: int  # the epoch the fit starts at (0-based)
    step: int  # batches of that epoch already trained
    skip_calls: int  # train-function calls that only consume input
    skip_extra: int  # batches a persistent iterator consumed past `step`
    steps_per_execution: int

    @classmethod
    def from_backup(cls, state: dict, directory: str, steps_per_execution: int):
        position = state["position"]
        step = int(position["step"])
        extra = 0
        if position.get("persistent"):
            extra = max(0, int(position["consumed"]) - step)
        return cls(state, directory, int(position["epoch"]), step,
                   math.ceil(step / steps_per_execution), extra, steps_per_execution)

    @property
    def position(self) -> dict:
        return self.state["position"]

    @property
    def seed(self) -> int | None:
        """The interrupted run's shuffle seed (a resumed run shuffles alike)."""
        return self.state.get("data", {}).get("seed")

    @property
    def hidden_batches(self) -> int:
        """Batches of the first epoch the other callbacks must not see."""
        return self.skip_calls * self.steps_per_execution

    def restarts_mid_execution(self) -> str | None:
        """The warning for a backup between two steps of one execution."""
        if self.step % self.steps_per_execution == 0:
            return None
        return (
            f"BackupAndRestore: the backup stopped at step {self.step}, not a "
            f"multiple of steps_per_execution={self.steps_per_execution}; the "
            f"resumed epoch restarts at step {self.hidden_batches}."
        )

    def input_target(self) -> int | None:
        """The number of input iterators to have created, or None: none to
        position (the first epoch from its start)."""
        position = self.position
        if position["epoch"] == 0 and self.step == 0 and not position.get("persistent"):
            return None
        created = int(position["created"])
        return created - 1 if (position.get("persistent") or self.step > 0) else created

    def restores_metrics(self, described_metrics: list) -> bool:
        """Whether the interrupted epoch's running means are restored.

        At step 0 (a backup taken at an epoch's end) the epoch starts with
        fresh running means, as Keras just reset them.
        """
        return bool(described_metrics) and self.step > 0 and (
            described_metrics == self.state["variables"].get("metrics")
        )


def describe(variables) -> list:
    return [[v.path, list(v.shape), str(v.dtype)] for v in variables]


def check_compatible(saved: dict, groups: dict, backup_dir: str) -> None:
    """Variables are matched by position, shape and dtype.

    Paths carry Keras' auto-numbered names (`dense_3`), which differ between
    two models built in one process, so they only serve to name the
    variables in the error.
    """
    problems = [
        problem for group in ("model", "optimizer")
        if (problem := mismatch(group, describe(groups[group]), saved.get(group, [])))
    ]
    if problems:
        raise ValueError(
            "BackupAndRestore: the backup in "
            f"{backup_dir!r} was written by a different model. "
            + ". ".join(problems)
            + ". Restore it into the model that wrote it, or point "
            "`backup_dir` at an empty directory to start over."
        )


def mismatch(group: str, ours: list, saved: list) -> str | None:
    """What differs between a group of variables and a backup's (None: nothing)."""
    theirs = [list(d) for d in saved]
    if [d[1:] for d in ours] == [d[1:] for d in theirs]:
        return None
    gone = sorted({_generic(d[0]) for d in theirs} - {_generic(d[0]) for d in ours})
    new = sorted({_generic(d[0]) for d in ours} - {_generic(d[0]) for d in theirs})
    detail = [f"{group}: the backup has {len(theirs)} variables, the model {len(ours)}"]
    if gone:
        detail.append("only in the backup: " + _shorten(gone))
    if new:
        detail.append("only in the model: " + _shorten(new))
    differ = [
        f"{o[0]} (model {o[1]} {o[2]}, backup {t[1]} {t[2]})"
        for o, t in zip(ours, theirs)
        if o[1:] != t[1:]
    ]
    if differ and not (gone or new):
        detail.append("different shape or dtype: " + _shorten(differ))
    return "; ".join(detail)


def changed_arguments(saved: dict, current: dict) -> str | None:
    """The warning for a fit whose arguments differ from the backed-up run."""
    changes = [
        f"{key} {saved[key]} -> {current[key]}"
        for key in sorted(current)
        if saved.get(key) is not None and current[key] is not None and saved[key] != current[key]
    ]
    if not changes:
        return None
    return (
        "BackupAndRestore: this fit differs from the backed-up run ("
        + ", ".join(changes)
        + "); the resumed run will not match an uninterrupted one."
    )


def _generic(path: str) -> str:
    """A variable path without Keras' auto-numbering (`dense_3` -> `dense`)."""
    return re.sub(r"_\d+(?=/|$)", "", path)


def _shorten(names: list) -> str:
    return ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
