"""Strategies: multi-worker tests, per-replica values and their reduction,
MirroredStrategy collective keys, updates from a cross-replica context.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """A MultiWorkerMirroredStrategy's own test for several processes."""
    return strategy.extended._in_multi_worker_mode()


def is_multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and in_multi_worker_mode(strategy)


def first_replica_batch(strategy: tf.distribute.Strategy, batch):
    """Replica 0's part of a distributed batch (enough for shapes)."""

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)


def reduce_per_replica(values, strategy, reduction: str):
    """Keras' `reduce_per_replica` with scalar-safe multi-worker means (fix 2)."""
    if reduction in ("auto", "mean") and is_multi_worker(strategy):
        return _packed_mean(values, strategy)
    return keras_tf_trainer.reduce_per_replica(values, strategy, reduction)


def _packed_mean(values, strategy):
    """The cross-replica mean of every log value, in one collective per dtype.

    A step's logs (loss, each metric) are float scalars: stacked into one
    vector per dtype, each group costs one all-reduce instead of one per
    value (every collective is a round trip between the workers). Other
    values are reduced one by one.
    """
    leaves = tf.nest.flatten(values)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        local = strategy.experimental_local_results(leaf)[0]
        if local.shape.rank == 0 and local.dtype.is_floating:
            groups.setdefault(local.dtype, []).append(i)
    reduced = list(leaves)
    for indices in groups.values():
        if len(indices) == 1:
            continue
        stacked = strategy.run(
            lambda *xs: tf.stack(xs), args=tuple(leaves[i] for i in indices)
        )
        means = tf.unstack(strategy.reduce("MEAN", stacked, axis=None))
        for i, mean in zip(indices, means):
            reduced[i] = mean
    reduced = [
        strategy.reduce("MEAN", v, axis=None) if reduced[i] is leaves[i] else v
        for i, v in enumerate(reduced)
    ]
    return tf.nest.pack_sequence_as(values, reduced)


@contextlib.contextmanager
def cross_replica_updates(strategy):
    """While open (in a cross-replica context, at trace time): Keras' TF
    optimizer updates its variables directly instead of through a
    `merge_call`, which needs a replica context.

    Keras' optimizer reaches `extended.update` through
    `maybe_merge_call`, which takes the direct path when the strategy says
    it needs no merge call (`_use_merge_call`); the update it then makes is
    the one a merge call would make, from the cross-replica context keras_dist
    is already in (see `_steps._apply_accumulating`).
    """
    extended = strategy.extended
    extended._use_merge_call = lambda: False  # this strategy object, not its class
    try:
        yield
    finally:
        del extended._use_merge_call


def mirrored_strategy(devices, collective_key_base: int) -> tf.distribute.Strategy:
    """A MirroredStrategy whose collective keys start at `collective_key_base`.

    TF starts the collective group keys of every MirroredStrategy at 1, so
    two strategies over different device sets collide in one process.
    """
    strategy = tf.distribute.MirroredStrategy.__new__(tf.distribute.MirroredStrategy)
    strategy._collective_key_base = collective_key_base
    strategy.__init__(devices=list(devices))
    return strategy


def set_model_strategy(model, strategy) -> None:
    """The strategy Keras' trainer runs the model's steps on (None: default)."""
    model._distribute_strategy = strategy


INTERNALS = {
    "keras.Model (compiled)": ("_distribute_strategy",),
    "keras.src.backend.tensorflow.trainer": ("reduce_per_replica",),
    "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended": (
        "_in_multi_worker_mode",
    ),
    "tensorflow.python.distribute.mirrored_strategy (source)": ("_collective_key_base",),
    # cross_replica_updates: the switch maybe_merge_call reads.
    "tensorflow.python.distribute.merge_call_interim (source)": ("_use_merge_call",),
    "tensorflow.python.distribute.values.PerReplicaSpec (source)": ("_value_specs",),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
