"""Batch-size arithmetic and input preparation for `DistributedModel`."""

from __future__ import annotations

import random

import numpy as np
import tensorflow as tf

from keras_dist import _keras_compat
from keras_dist.strategy import worker_info

_KERAS_DEFAULT_BATCH_SIZE = 32


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(
            f"Invalid type for argument `{name}`. Expected a positive integer. "
            f"Received: {name}={value!r} of type {type(value).__name__}."
        )
    if value <= 0:
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a positive integer. "
            f"Received: {name}={value}."
        )


def is_dataset_like(x) -> bool:
    return isinstance(
        x, (tf.data.Dataset, tf.distribute.DistributedDataset)
    ) or hasattr(x, "__next__") or type(x).__name__ in ("PyDataset",) or (
        hasattr(x, "__getitem__") and hasattr(x, "__len__") and hasattr(x, "on_epoch_end")
    )


def global_batch_size(
    strategy: tf.distribute.Strategy,
    x,
    batch_size,
    per_replica_batch_size,
    batch_arg: str = "batch_size",
):
    """Returns the global batch size to hand to Keras (None for datasets).

    Raises:
        ValueError/TypeError: both sizes given, a non-positive size, or a
            global batch that the replicas cannot split evenly.
    """
    replicas = strategy.num_replicas_in_sync
    if batch_size is not None and per_replica_batch_size is not None:
        raise ValueError(
            f"Arguments `{batch_arg}` and `per_replica_batch_size` are mutually "
            f"exclusive. Received: {batch_arg}={batch_size}, "
            f"per_replica_batch_size={per_replica_batch_size}. Pass "
            f"`{batch_arg}` for the global batch or `per_replica_batch_size` "
            f"(global batch = per_replica_batch_size x {replicas} replicas)."
        )
    if per_replica_batch_size is not None:
        _check_positive_int("per_replica_batch_size", per_replica_batch_size)
        if is_dataset_like(x):
            raise ValueError(
                "Argument `per_replica_batch_size` cannot be used with a "
                "dataset or generator input, which is batched already. "
                f"Received: per_replica_batch_size={per_replica_batch_size} "
                f"with x of type {type(x).__name__}. Batch the dataset with "
                f"per_replica_batch_size x {replicas} instead."
            )
        return int(per_replica_batch_size) * replicas
    if batch_size is not None:
        _check_positive_int(batch_arg, batch_size)
    if is_dataset_like(x):
        _check_dataset_batch(x, replicas)
        return batch_size
    size = _KERAS_DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)
    if size % replicas:
        shown = f"{batch_arg}={batch_size}" if batch_size is not None else (
            f"{batch_arg}=None (Keras' default of {size})"
        )
        raise ValueError(
            f"Invalid value for argument `{batch_arg}`: the global batch must "
            f"split evenly over the {replicas} replicas in sync. Received: "
            f"{shown}. Use a multiple of {replicas} (e.g. "
            f"{batch_arg}={max(replicas, size - size % replicas)}), or pass "
            f"per_replica_batch_size={max(1, size // replicas)}."
        )
    return size


def _check_dataset_batch(x, replicas: int) -> None:
    if not isinstance(x, tf.data.Dataset) or replicas == 1:
        return
    leaves = tf.nest.flatten(x.element_spec)
    if not leaves or not hasattr(leaves[0], "shape"):
        return
    shape = leaves[0].shape
    if shape.rank and shape[0] is not None and shape[0] % replicas:
        raise ValueError(
            "Invalid dataset for argument `x`: its batches of "
            f"{shape[0]} samples cannot split evenly over the {replicas} "
            f"replicas in sync. Received: x with element_spec batch size "
            f"{shape[0]}. Batch it with a multiple of {replicas}."
        )


def is_array_structure(value) -> bool:
    leaves = tf.nest.flatten(value)
    return bool(leaves) and all(
        isinstance(v, (np.ndarray, tf.Tensor)) for v in leaves
    )


def agreed_seed(strategy: tf.distribute.Strategy) -> int:
    """A random seed drawn by the chief and shared with every worker."""
    local = random.SystemRandom().randrange(1, 2**31 - 1)
    chief = worker_info(strategy).is_chief

    def contribution():
        context = tf.distribute.get_replica_context()
        first = tf.equal(context.replica_id_in_sync_group, 0)
        value = tf.constant(local if chief else 0, tf.int64)
        return tf.where(first, value, tf.zeros_like(value))

    seed = strategy.reduce(
        "SUM", strategy.run(tf.function(contribution)), axis=None
    )
    return int(seed.numpy())


def shardable_arrays(strategy, x, y, sample_weight, batch_size, shuffle):
    """Turns in-memory arrays into a dataset every worker orders alike.

    Under `MultiWorkerMirroredStrategy` each worker keeps its own share of
    every global batch (auto-shard policy DATA). That is exact only if all
    workers shuffle identically, which Keras' array adapter does not
    guarantee (an unseeded `tf.random.shuffle` per worker). Here the chief
    draws the shuffle seed and every worker uses it.

    Returns None when the inputs are not plain arrays or no multi-worker
    strategy is in use; then Keras' own adapters are used.
    """
    if not _keras_compat.is_multi_worker(strategy):
        return None
    data = (x,) if y is None else (x, y)
    if sample_weight is not None:
        data = (x, y, sample_weight)
    if not is_array_structure(data):
        return None
    num_samples = int(tf.nest.flatten(x)[0].shape[0])
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    indices = tf.data.Dataset.range(num_samples)
    if shuffle:
        if shuffle == "batch":
            raise ValueError(
                'shuffle="batch" is not supported under multi-worker '
                'training. Received: shuffle="batch". Use shuffle=True.'
            )
        indices = indices.shuffle(
            num_samples, seed=agreed_seed(strategy), reshuffle_each_iteration=True
        )
    dataset = indices.batch(batch_size).map(
        lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), tensors),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
