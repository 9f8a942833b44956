"""Callback touch points: the state of Keras' stateful callbacks, the epoch
`fit` starts at, Keras' global seed state, the optimizer's rate variable
(`LearningRateScaler`).
"""

from __future__ import annotations

import os

import keras


def learning_rate_variable(optimizer):
    """What an optimizer reads its rate from: a variable or a schedule.

    (`optimizer.learning_rate` evaluates a schedule; the scaler needs the
    object itself, to wrap it and to put it back.)
    """
    return optimizer._learning_rate


def set_learning_rate_variable(optimizer, value) -> None:
    optimizer._learning_rate = value


KERAS_CALLBACK_STATE = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.ModelCheckpoint: (
        "best",
        "_batches_seen_since_last_saving",
        "_last_batch_seen",
    ),
}
"""The attributes that make up the state of Keras' stateful callbacks, which
have no `get_state()`: saved in a backup, set again on resume."""


KERAS_BACKUP_PATHS = (
    "backup_dir",
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
)
"""Where `keras.callbacks.BackupAndRestore` writes: its directory and the
four files in it (read at `on_train_begin`, written at every save, the
directory deleted at `on_train_end`)."""


def keras_backup_paths(callback) -> dict:
    """The paths a `keras.callbacks.BackupAndRestore` reads and writes."""
    return {name: getattr(callback, name) for name in KERAS_BACKUP_PATHS}


def keras_backup_paths_in(callback, directory: str) -> dict:
    """The same files as `callback`'s, in `directory`."""
    paths = {"backup_dir": directory}
    for name in KERAS_BACKUP_PATHS[1:]:
        paths[name] = os.path.join(directory, os.path.basename(getattr(callback, name)))
    return paths


def set_keras_backup_paths(callback, paths: dict) -> None:
    for name, value in paths.items():
        setattr(callback, name, value)


def set_initial_epoch(model, epoch: int | None) -> None:
    """Keras' fit reads `model._initial_epoch` after `on_train_begin`."""
    model._initial_epoch = epoch


def global_seed_variables(create: bool = False) -> list:
    """The state of Keras' global SeedGenerator (unseeded `keras.random`);
    `create`: made first where this process has none yet (as Keras' first
    unseeded random call makes it)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    generator = global_state.get_global_attribute("global_seed_generator")
    if generator is None and create:
        generator = seed_generator.global_seed_generator()
    return [generator.state] if generator is not None else []


def keras_metrics_only(metrics) -> bool:
    """Whether every metric in `metrics` is a Keras class, at any depth.

    Keras' own containers (`CompileMetrics`, `CompileLoss`) are looked
    into; a metric defined anywhere else (a user's subclass) is not.
    """
    for metric in metrics:
        if not type(metric).__module__.startswith("keras."):
            return False
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and not keras_metrics_only(inner):
            return False
    return True


INTERNALS = {
    "keras.optimizers.Optimizer (built)": ("_learning_rate",),
    "keras.callbacks.ModelCheckpoint (built)": (
        "_batches_seen_since_last_saving",
        "_last_batch_seen",
    ),
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit (source)": (
        "_initial_epoch",
    ),
    "keras.src.backend.common.global_state": ("get_global_attribute",),
    "keras.src.random.seed_generator": ("global_seed_generator",),
    "keras.src.callbacks.backup_and_restore.BackupAndRestore.__init__ (source)": (
        KERAS_BACKUP_PATHS[1:]
    ),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
