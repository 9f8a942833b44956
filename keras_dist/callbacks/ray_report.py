"""`RayReport`: a Keras 3 callback that reports to Ray Train."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

import keras


class RayReport(keras.callbacks.Callback):
    """Reports each epoch's logs to Ray Train (`ray.train.report`).

    For a Keras 3 model trained inside Ray Train's `TensorflowTrainer`:
    Ray's own Keras callbacks import `tensorflow.keras`, which Ray's
    TensorFlow workers point at the legacy tf-keras package
    (`TF_USE_LEGACY_KERAS=1`), so they cannot load beside Keras 3. Runs on
    every worker (Ray wants every worker's report). With each report goes
    a Ray checkpoint holding the model's weights (`model.weights.h5`,
    written by every worker, the chief's kept), so `trainer.fit()`'s
    result has the last epoch's logs as `metrics` (plus `epoch`, counted
    from 1) and its weights as `checkpoint`:
    `model.load_weights(os.path.join(directory, "model.weights.h5"))`
    inside `result.checkpoint.as_directory()`.

    Args:
        metrics: None (every log), a list of log names, or a dict
            `{reported name: log name}`.
        checkpoint: Boolean, default True: report the weights with the
            metrics (Ray Train keeps reported metrics only with a
            checkpoint). For resuming mid-epoch, use keras_dist's
            `BackupAndRestore` on the run's storage beside it.

    Example (inside the training function):

        model.fit(x, y, epochs=10, callbacks=[
            keras_dist.callbacks.BackupAndRestore(backup_dir),
            keras_dist.callbacks.RayReport(["loss", "val_loss"])])
    """

    def __init__(self, metrics: Sequence[str] | Mapping[str, str] | None = None,
                 checkpoint: bool = True):
        super().__init__()
        if not isinstance(checkpoint, bool):
            raise TypeError(
                "Invalid type for argument `checkpoint`. Expected a bool. "
                f"Received: checkpoint={checkpoint!r}"
            )
        self.checkpoint = checkpoint
        pairs = (
            list(metrics.items()) if isinstance(metrics, Mapping)
            else [(name, name) for name in metrics]
            if isinstance(metrics, Sequence) and not isinstance(metrics, str) else None
        )
        if metrics is not None and (
            pairs is None or not all(isinstance(n, str) for pair in pairs for n in pair)
        ):
            raise TypeError(
                "Invalid type for argument `metrics`. Expected None, a list of "
                "log names or a dict {reported name: log name}. Received: "
                f"metrics={metrics!r}"
            )
        self.metrics = dict(pairs) if pairs is not None else None

    def on_train_begin(self, logs=None):
        try:
            import ray.train
        except ImportError:
            raise ImportError(
                "RayReport needs Ray Train: pip install \"ray[train]\" (or "
                "keras-dist's `ray` extra)."
            ) from None
        try:
            self._rank = ray.train.get_context().get_world_rank()
        except Exception as error:  # Ray's own error type varies by version
            raise RuntimeError(
                "RayReport reports to Ray Train and runs only inside a Ray Train "
                "worker (the function a TensorflowTrainer runs). Received: a fit "
                f"outside one ({type(error).__name__}: {error}). Remove the "
                "callback where Ray does not run the training."
            ) from None
        self._report, self._checkpoint_from = ray.train.report, ray.train.Checkpoint.from_directory

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        chosen = logs if self.metrics is None else {
            reported: logs[name] for reported, name in self.metrics.items() if name in logs
        }
        missing = [] if self.metrics is None else sorted(
            name for name in self.metrics.values() if name not in logs)
        if missing:
            raise ValueError(
                f"RayReport: no log named {missing} at the end of epoch {epoch + 1}. "
                f"Received: metrics={self.metrics!r}; the logs are {sorted(logs)}. "
                "Name logs that fit produces (validation logs need validation data)."
            )
        report = {name: float(value) for name, value in chosen.items()}
        report["epoch"] = epoch + 1
        if not self.checkpoint:
            self._report(report)
            return
        with tempfile.TemporaryDirectory(prefix="keras_dist_ray_") as directory:
            # Every worker writes (reading some variables is a collective);
            # the chief's copy is the checkpoint (Ray copies it during the call).
            self.model.save_weights(os.path.join(directory, "model.weights.h5"))
            self._report(report, checkpoint=self._checkpoint_from(directory)
                         if self._rank == 0 else None)

