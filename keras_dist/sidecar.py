"""`SidecarEvaluator`: an evaluator task that evaluates training's checkpoints.

Keras 3 has no `keras.utils.SidecarEvaluator` (tf.keras had one), while
managed jobs (Vertex AI, SageMaker, Kubeflow's TFJob) still start an
`evaluator` task beside the chief and workers. This one evaluates, as
they appear, the checkpoints that training writes:

- keras_dist `BackupAndRestore` backups (each verified against its
  manifest before it is read; the final backup of a fit ends the loop),
- Keras `ModelCheckpoint` files (`*.weights.h5`, `*.keras`),
- `tf.train.Checkpoint` / `CheckpointManager` checkpoints (`ckpt-N`).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import time
import warnings

import tensorflow as tf

from keras_dist import _backup_store as store
from keras_dist import _checks, _resume
from keras_dist.callbacks.backup_and_restore import backup_groups, holds_global_seed

# Errors of a checkpoint that training is writing or pruning right now:
# tried again at the next look (a newer one usually replaces it).
_IN_FLUX = (OSError, ValueError, tf.errors.OpError, store.CorruptBackupError)
# Checkpoints in a row that fail to load before the error is raised: one
# that training replaced while it was read does not fail three times.
_FAILURES_IN_A_ROW = 3
_KERAS_FILES = ("*.weights.h5", "*.keras")


@dataclasses.dataclass
class _Found:
    kind: str  # "backup", "keras" or "checkpoint"
    path: str
    key: tuple  # what identifies this checkpoint (a rewritten file is new)
    mtime: float
    number: int | None  # its epoch (backups) or the first number in its name
    label: str


class SidecarEvaluator:
    """Evaluates the checkpoints a training job writes, as they appear.

    Run it in the `evaluator` task of a job (`keras_dist.worker_info()
    .task_type == "evaluator"`) or in any process that sees the training's
    checkpoint directory. Each time a new checkpoint appears it loads it
    into `model` and runs `model.evaluate(data, steps=steps,
    callbacks=callbacks)`; when training writes several while one is being
    evaluated, the newest is taken next (as in tf.keras).

    The loop ends after a keras_dist backup that is the last of its fit
    (`BackupAndRestore(delete_checkpoint=False)` writes one when `fit`
    ends), when the directory disappears after it held backups (`fit`
    ended and deleted them), after a checkpoint whose number is
    `max_evaluations` or more (a backup's number is its epoch; a file's
    the first number in its name: `ckpt-{epoch}.weights.h5`,
    `model.{epoch:02d}-{val_loss:.2f}.keras`), or after
    `timeout` seconds without a new checkpoint. A checkpoint that fails to
    load is skipped with a line saying why (training may be replacing it);
    three in a row raise the last error (a model of another architecture).

    Args:
        model: A compiled Keras model (the same architecture as the one
            trained, built: its variables are restored), with the loss and
            metrics to evaluate.
        data: The evaluation data: a `tf.data.Dataset` (or anything
            `model.evaluate` takes as `x`), or a tuple `(x, y)` /
            `(x, y, sample_weight)` of arrays (a multi-input model's `x`
            inside it: `((x1, x2), y)`).
        checkpoint_dir: The directory training writes its checkpoints to
            (a `BackupAndRestore` `backup_dir`, a `ModelCheckpoint`
            directory, or a `CheckpointManager` directory).
        steps: Batches per evaluation; None evaluates the whole of `data`.
        max_evaluations: Stop after a checkpoint numbered this or more.
        callbacks: Keras callbacks passed to every `evaluate` call.
        poll_interval: Seconds between looks at the directory.
        timeout: Seconds without a new checkpoint before the loop ends;
            None waits until one of the other ends.
        verbose: Passed to `model.evaluate`.

    `start()` returns the evaluations made, one dict per checkpoint:
    `{"checkpoint", "epoch", "iterations", <metric>: value, ...}` (also
    kept in `history`).
    """

    def __init__(
        self,
        model,
        data,
        checkpoint_dir: str | os.PathLike,
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks=None,
        *,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        verbose: int = 0,
    ):
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
            raise ValueError(
                "Invalid value for argument `checkpoint_dir`. Expected the path "
                "of the directory training writes its checkpoints to. Received: "
                f"checkpoint_dir={checkpoint_dir!r}"
            )
        for name, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            if value is not None:
                _checks.check_count(name, value)
        for name, value in (("poll_interval", poll_interval), ("timeout", timeout)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0
            ):
                raise ValueError(
                    f"Invalid value for argument `{name}`. Expected a positive, "
                    f"finite number of seconds. Received: {name}={value!r}"
                )
        if not getattr(model, "compiled", False):
            raise ValueError(
                "SidecarEvaluator: `model` must be compiled with the loss and "
                "metrics to evaluate. Received: an uncompiled model "
                f"{getattr(model, 'name', model)!r}. Call model.compile(loss=..., "
                "metrics=[...]) first."
            )
        self.model = model
        self.data = data
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.callbacks = list(callbacks or [])
        self.poll_interval = float(poll_interval)
        self.timeout = timeout
        self.verbose = verbose
        self.history: list[dict] = []

    # -- the loop ------------------------------------------------------------

    def start(self) -> list[dict]:
        """Evaluates checkpoints until one of the ends (see the class)."""
        if not self.model.built:
            raise ValueError(
                "SidecarEvaluator: the model has no variables to load checkpoints "
                f"into. Received: model {self.model.name!r}, not built. Build it "
                "first (call it on one batch of inputs, or model.build(input_shape)).")
        seen, had_backups, waited_since, said_waiting = set(), False, time.monotonic(), False
        failures = 0
        while True:
            had_backups = had_backups or bool(store.list_backups(self.checkpoint_dir))
            found = self._newest(seen)
            if found is None:
                if had_backups and not os.path.isdir(self.checkpoint_dir):
                    return self._end("training deleted its backups: it finished")
                waited = time.monotonic() - waited_since
                if self.timeout is not None and waited >= self.timeout:
                    return self._end(f"no new checkpoint for {waited:.0f}s (timeout)")
                if not said_waiting and waited >= 5 * self.poll_interval:
                    said_waiting = True
                    print(f"SidecarEvaluator: waiting for a checkpoint in "
                          f"{self.checkpoint_dir}", flush=True)
                time.sleep(self.poll_interval)
                continue
            seen.add(found.key)
            try:
                final = self._load(found)
            except _IN_FLUX as error:
                failures += 1
                if failures >= _FAILURES_IN_A_ROW:
                    raise
                print(f"SidecarEvaluator: skipped {found.label} ({type(error).__name__}: "
                      f"{error}); training may be writing or removing it: looking again",
                      flush=True)
                continue
            failures = 0
            self._evaluate(found)
            waited_since, said_waiting = time.monotonic(), False
            if final:
                return self._end(f"{found.label} is the last of its fit")
            if self.max_evaluations is not None and (found.number or 0) >= self.max_evaluations:
                return self._end(f"{found.label} reached max_evaluations={self.max_evaluations}")

    def _end(self, why: str) -> list[dict]:
        print(f"SidecarEvaluator: stopped after {len(self.history)} evaluation(s): {why}",
              flush=True)
        return self.history

    def _evaluate(self, found: _Found) -> None:
        data = self.data
        arrays = dict(zip(("x", "y", "sample_weight"), data)) if isinstance(
            data, tuple) else {"x": data}
        logs = self.model.evaluate(**arrays, steps=self.steps, callbacks=self.callbacks,
                                   verbose=self.verbose, return_dict=True)
        optimizer = getattr(self.model, "optimizer", None)
        iterations = int(optimizer.iterations.numpy()) if optimizer is not None else None
        record = {"checkpoint": found.path, "epoch": found.number,
                  "iterations": iterations, **{k: float(v) for k, v in logs.items()}}
        self.history.append(record)
        numbers = " ".join(f"{k}={float(v):.6g}" for k, v in logs.items())
        print(f"SidecarEvaluator: {found.label}: {numbers}", flush=True)

    # -- finding checkpoints ---------------------------------------------------

    def _newest(self, seen: set) -> _Found | None:
        """The most recently written checkpoint not evaluated yet, or None."""
        candidates = [c for c in (self._backup(), self._tf_checkpoint(), self._keras_file())
                      if c is not None and c.key not in seen]
        return max(candidates, key=lambda c: c.mtime, default=None)

    def _backup(self) -> _Found | None:
        sequences = store.list_backups(self.checkpoint_dir)
        if not sequences:
            return None
        path = os.path.join(self.checkpoint_dir, store.backup_name(sequences[0]))
        return _Found("backup", path, ("backup", sequences[0]), _mtime(path), None,
                      store.backup_name(sequences[0]))

    def _tf_checkpoint(self) -> _Found | None:
        if not os.path.isfile(os.path.join(self.checkpoint_dir, "checkpoint")):
            return None
        prefix = tf.train.latest_checkpoint(self.checkpoint_dir)
        if prefix is None:
            return None
        return _Found("checkpoint", prefix, ("checkpoint", prefix),
                      _mtime(prefix + ".index"), _epoch_in_name(prefix), os.path.basename(prefix))

    def _keras_file(self) -> _Found | None:
        files = [p for pattern in _KERAS_FILES
                 for p in glob.glob(os.path.join(glob.escape(self.checkpoint_dir), pattern))]
        found = []
        for path in files:
            try:
                stat = os.stat(path)
            except OSError:
                continue  # removed since the listing
            found.append(_Found("keras", path, ("keras", path, stat.st_mtime_ns, stat.st_size),
                                stat.st_mtime, _epoch_in_name(path), os.path.basename(path)))
        return max(found, key=lambda c: (c.mtime, c.number or 0), default=None)

    # -- loading -------------------------------------------------------------

    def _load(self, found: _Found) -> bool:
        """Loads `found` into the model; True when it is a fit's last backup."""
        if found.kind == "keras":
            with warnings.catch_warnings():
                # A `.keras` file's optimizer state does not matter here.
                warnings.filterwarnings("ignore", message="Skipping variable loading")
                self.model.load_weights(found.path)
            return False
        if found.kind == "checkpoint":
            parts = {"model": self.model}
            if getattr(self.model, "optimizer", None) is not None:
                parts["optimizer"] = self.model.optimizer
            tf.train.Checkpoint(**parts).read(found.path).expect_partial()
            return False
        return self._load_backup(found)

    def _load_backup(self, found: _Found) -> bool:
        state = store.verify(found.path)
        # The model's own variables: the state of the training process's
        # global SeedGenerator (the last entry where it had one) is not
        # the model's, and this process's own is left as it is.
        groups = backup_groups(self.model, build_optimizer=False, global_seed=False)
        saved = state["variables"].get("model", [])
        if holds_global_seed(saved, len(groups["model"])):
            saved = saved[:-1]
        problem = _resume.mismatch("model", _resume.describe(groups["model"]), saved)
        if problem:
            raise TypeError(
                f"SidecarEvaluator: the backups in {self.checkpoint_dir!r} are not "
                f"of this model ({problem}). Pass the model training builds.")
        tf.train.Checkpoint(model=groups["model"]).read(
            os.path.join(found.path, "variables")).expect_partial()
        if hasattr(self.model, "__keras_dist_restore_backup_variables__"):
            self.model.__keras_dist_restore_backup_variables__()
        optimizer = getattr(self.model, "optimizer", None)
        saved_iterations = state["variables"].get("optimizer", [])
        if optimizer is not None and saved_iterations and (
                saved_iterations[0][0].endswith("/iteration")):
            # The step training was at (TensorBoard's x axis for evaluations).
            reader = tf.train.load_checkpoint(os.path.join(found.path, "variables"))
            optimizer.iterations.assign(
                reader.get_tensor("optimizer/0/.ATTRIBUTES/VARIABLE_VALUE"))
        position = state["position"]
        found.number = int(position["epoch"])
        found.label = (f"{os.path.basename(found.path)} (epoch {position['epoch']}, "
                       f"step {position['step']})")
        fit = state.get("fit", {})
        return bool(state.get("final")) or (
            position["step"] == 0 and fit.get("epochs") is not None
            and position["epoch"] >= fit["epochs"])


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _epoch_in_name(path: str) -> int | None:
    """The first number in a checkpoint's name (Keras' `{epoch}` comes first
    in its documented patterns), or None."""
    numbers = re.findall(r"\d+", os.path.basename(path))
    return int(numbers[0]) if numbers else None
