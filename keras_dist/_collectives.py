"""Collectives and rank logic: the one place where workers talk or agree.

Every decision that changes training is agreed here, with one collective
that every worker issues in the same order (see STYLE.md, Callbacks):

- `is_multi_worker`: whether a strategy spans several processes.
- `agree_sum` / `agree_any`: integer totals / a vote over the workers.
- `agreed_seed`: a shuffle seed drawn by the chief, shared by all.
- `broadcast_from_chief`: an int64 vector from the chief to every worker.
- `agree_on_finite`: in a replica step, the loss-scale verdict made global.
- `callbacks_for_this_worker`: Keras' file-writing callbacks on the chief
  only; Keras' `BackupAndRestore` writes the shared backup on the chief only.

`worker_info` (the public rank description) lives in `keras_dist.strategy`.
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _keras_compat, _liveness
from keras_dist.strategy import WorkerInfo, worker_info


class ProcessGroup:
    """The processes of one job that trains outside a tf.distribute strategy
    (a `keras_dist.dtensor` mesh over several processes), where a strategy
    is expected below: `rank` (process 0 is the chief), `num_workers`, and
    `total(values)`, the sums of every process's integer values (one
    collective every process joins, in the same order)."""

    def __init__(self, rank: int, num_workers: int, total):
        self.rank, self.num_workers, self.total = rank, num_workers, total


def group_of(model):
    """The processes `model` trains over: a `ProcessGroup` where the model
    has one (`__keras_dist_process_group__`), else its strategy."""
    hook = getattr(model, "__keras_dist_process_group__", None)
    group = hook() if hook is not None else None
    return group if group is not None else model.distribute_strategy


def process_info(strategy) -> WorkerInfo:
    """`worker_info` for a strategy or a `ProcessGroup`."""
    if isinstance(strategy, ProcessGroup):
        return WorkerInfo(strategy.num_workers, strategy.rank, strategy.rank == 0)
    return worker_info(strategy)


def is_multi_worker(strategy) -> bool:
    """Whether `strategy` (or a `ProcessGroup`) spans several processes:
    a MultiWorkerMirroredStrategy over several, or a group of several."""
    if isinstance(strategy, ProcessGroup):
        return strategy.num_workers > 1
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and _keras_compat.in_multi_worker_mode(strategy)


def is_chief(strategy) -> bool:
    return process_info(strategy).is_chief


# Keras' callbacks whose only effect is a file or a request for the user
# (none issues a collective or changes training): under multi-worker
# training the chief's alone runs, so a job leaves what one process leaves
# (one event file per TensorBoard run directory, one CSV writer, one request
# per epoch). Exact classes: a subclass may do more, and runs everywhere
# (a CSVLogger's or TensorBoard's writing privately off the chief: PRIVATE_PATHS).
CHIEF_ONLY_CALLBACKS = (
    keras.callbacks.CSVLogger,
    keras.callbacks.RemoteMonitor,
    keras.callbacks.TensorBoard,
)


def callbacks_for_this_worker(strategy: tf.distribute.Strategy, callbacks):
    """`callbacks` as this worker runs them: without the chief-only ones on
    the other workers of a multi-worker job (see `CHIEF_ONLY_CALLBACKS`)."""
    if not is_multi_worker(strategy):
        return callbacks
    return callbacks_for_this_process(callbacks, chief=is_chief(strategy))


def callbacks_for_this_process(callbacks, chief: bool):
    """`callbacks` as one process of a multi-process job runs them (a
    multi-worker strategy's, or a DTensor mesh's over several processes):
    all of them on the chief; elsewhere without the chief-only ones (exact
    classes), Keras' `BackupAndRestore` writing privately
    (`_PrivateBackupWrites`), and a user's subclass of a chief-only callback
    running with its files written privately (`_PrivateFileWrites`)."""
    if not isinstance(callbacks, (list, tuple)) or chief:
        return callbacks
    kept = []
    for c in callbacks:
        if type(c) in CHIEF_ONLY_CALLBACKS:
            continue
        if isinstance(c, keras.callbacks.BackupAndRestore):
            kept.append(_PrivateBackupWrites(c))
        elif isinstance(c, tuple(PRIVATE_PATHS)):
            # A user's subclass: it may do more than write, so it runs on
            # every worker, its files written to a private scratch path.
            attribute = next(a for k, a in PRIVATE_PATHS.items() if isinstance(c, k))
            kept.append(_PrivateFileWrites(c, attribute))
        else:
            kept.append(c)
    return kept


# Subclasses of the chief-only callbacks (the attribute naming where each
# writes): run on every worker, writing privately off the chief.
PRIVATE_PATHS = {
    keras.callbacks.CSVLogger: "filename",
    keras.callbacks.TensorBoard: "log_dir",
}

_HOOKS = tuple(
    f"on_{stage}_{event}"
    for stage in ("train", "epoch", "train_batch", "test", "test_batch", "predict",
                  "predict_batch")
    for event in ("begin", "end")
)


class _Private(keras.callbacks.Callback):
    """Runs `callback` on a worker that is not the chief, every hook (and
    `set_model`) with the callback's paths switched to a private scratch
    directory for the call only (`_switch`): the callback is left as the
    user made it, even when `fit` raises. The scratch directory goes at
    the end of training. Each kind defines `_switch(directory)`: points the
    callback's paths into `directory` and returns the undo."""

    shared_hooks: tuple = ()  # hooks that see the shared paths

    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self._scratch = None

    def set_model(self, model):
        super().set_model(model)
        self._privately(self.callback.set_model, model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def _privately(self, hook, *args, **kwargs):
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="keras_dist_worker_")
        restore = self._switch(self._scratch.name)
        try:
            hook(*args, **kwargs)
        finally:
            restore()

    def _hook(self, name, *args, **kwargs):
        hook = getattr(self.callback, name)
        if name in self.shared_hooks:
            hook(*args, **kwargs)
        else:
            self._privately(hook, *args, **kwargs)
        if name == "on_train_end" and self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


for _name in _HOOKS:
    setattr(_Private, _name,
            lambda self, *args, _name=_name, **kwargs: self._hook(_name, *args, **kwargs))


class _PrivateBackupWrites(_Private):
    """Keras' `BackupAndRestore` (or a subclass) on a worker that is not the chief.

    Every worker restores from the shared `backup_dir` (all must start from
    the same step; `on_train_begin` sees the shared paths); only the chief
    writes and deletes it. The others save (their `save_weights` is a
    collective every worker joins) into a private scratch directory, so
    that two workers never copy, truncate or delete the same file (which
    failed with FileNotFoundError when both deleted the directory at the
    end of training; on a DTensor mesh h5py's file lock failed).
    """

    shared_hooks = ("on_train_begin",)

    def set_model(self, model):
        keras.callbacks.Callback.set_model(self, model)
        self.callback.set_model(model)

    def _switch(self, directory):
        shared = _keras_compat.keras_backup_paths(self.callback)
        _keras_compat.set_keras_backup_paths(
            self.callback, _keras_compat.keras_backup_paths_in(self.callback, directory))
        return lambda: _keras_compat.set_keras_backup_paths(self.callback, shared)


class _PrivateFileWrites(_Private):
    """A user's subclass of a chief-only callback (`PRIVATE_PATHS`) on a
    worker that is not the chief: it runs (it may do more than write), its
    file or log directory in a private scratch directory, so that the job
    leaves the chief's files only."""

    def __init__(self, callback, attribute: str):
        super().__init__(callback)
        self._attribute = attribute

    def _switch(self, directory):
        shared = getattr(self.callback, self._attribute)
        name = os.path.basename(os.path.normpath(str(shared))) or "files"
        setattr(self.callback, self._attribute, os.path.join(directory, name))
        return lambda: setattr(self.callback, self._attribute, shared)


_SUM_FUNCTIONS: dict = {}


def _first_replicas_sum(strategy: tf.distribute.Strategy):
    """A function `tensor -> numpy`: the sum of every worker's value (one collective).

    Each worker's first replica contributes the value its worker passes
    (the others zeros); every worker gets the total. Compiled once per
    strategy: a single collective and no eager round trips (an eager
    `strategy.reduce` costs ~0.2 s per call on two CPU workers).
    """
    if id(strategy) in _SUM_FUNCTIONS:
        return _SUM_FUNCTIONS[id(strategy)]
    # Worker w's replicas are w * local ... w * local + local - 1 in the sync
    # group: each worker's first is the one whose id `local` divides.
    local = len(strategy.extended.worker_devices)

    def contribution(value):
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group % local, 0)
        # The identity puts the value on the replica's device
        # (MultiWorkerMirroredStrategy finds no destination for a host tensor).
        value = tf.where(first, tf.identity(value), tf.zeros_like(value))
        return context.all_reduce("SUM", value)

    @tf.function
    def total(value):
        return strategy.run(contribution, args=(value,))

    def call(value):
        with _liveness.in_collective():  # for the launcher's hang detection
            result = total(tf.convert_to_tensor(value))
            return strategy.experimental_local_results(result)[0].numpy()

    _SUM_FUNCTIONS[id(strategy)] = call
    return call


def agree_sum(strategy: tf.distribute.Strategy, values) -> list[int]:
    """Sums integer `values` over the workers (one collective).

    Each worker's first replica contributes its values; every worker gets
    the totals. Without multiple workers the values come back unchanged.
    """
    if not is_multi_worker(strategy):
        return [int(v) for v in values]
    if isinstance(strategy, ProcessGroup):
        return [int(v) for v in strategy.total([int(v) for v in values])]
    total = _first_replicas_sum(strategy)(
        tf.constant([int(v) for v in values], tf.int64)
    )
    return [int(v) for v in total]


def agree_any(strategy: tf.distribute.Strategy, flags) -> list[bool]:
    """For each flag, whether any worker raised it (one collective)."""
    return [total > 0 for total in agree_sum(strategy, [bool(f) for f in flags])]


def agreed_seed(strategy: tf.distribute.Strategy) -> int:
    """A shuffle seed drawn by the chief and shared with every worker.

    Drawn from NumPy's global generator, so `keras.utils.set_random_seed`
    makes it reproducible.
    """
    local = int(np.random.randint(1, 2**31 - 1))
    if not is_multi_worker(strategy):
        return local
    return agree_sum(strategy, [local if is_chief(strategy) else 0])[0]


def agreed_global_seed(strategy: tf.distribute.Strategy, seed: int | None) -> int | None:
    """`seed` (this worker's TensorFlow global seed, or None) if every
    worker has that same one, else None (one collective under multi-worker
    training).

    Each worker contributes 1, whether its seed is set, and each 21-bit
    chunk `c` of the seed with `c * c`: the chunks of N workers are all
    equal exactly when (sum of c)^2 = N * (sum of c^2).
    """
    if not is_multi_worker(strategy):
        return seed
    value = 0 if seed is None else int(seed) % 2**63
    chunks = [(value >> shift) & (2**21 - 1) for shift in (0, 21, 42)]
    local = [1, seed is not None]
    for chunk in chunks:
        local += [chunk, chunk * chunk]
    total = agree_sum(strategy, local)
    workers, seeded = total[0], total[1]
    equal = all(total[i] ** 2 == workers * total[i + 1] for i in (2, 4, 6))
    return seed if seeded == workers and equal else None


def broadcast_from_chief(strategy: tf.distribute.Strategy):
    """A function `vector -> numpy vector` that every worker calls together.

    The chief passes the value, the others zeros of the same shape and
    dtype; each gets the chief's value back (one all-reduce, to which each
    worker's first replica contributes).
    """
    return _first_replicas_sum(strategy)


def agree_on_finite(optimizer, gradients, context):
    """Makes every replica see non-finite gradients if any replica does.

    Keras' `LossScaleOptimizer` decides whether to apply or skip a step from
    the *local* (not yet all-reduced) gradients. Replicas that disagree
    either apply an infinite update (MirroredStrategy takes replica 0's
    verdict) or hang (MultiWorkerMirroredStrategy branches around the
    all-reduce). One scalar all-reduce makes the verdict global.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return gradients
    local_ok = optimizer.check_finite(gradients)
    bad = context.all_reduce("SUM", tf.cast(tf.logical_not(local_ok), tf.float32))
    poison = tf.where(bad > 0.0, float("nan"), 1.0)

    def apply(g):
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(
                g.values * tf.cast(poison, g.values.dtype), g.indices, g.dense_shape
            )
        return g * tf.cast(poison, g.dtype)

    return [apply(g) for g in gradients]
