"""Batch-size arithmetic and input preparation for `DistributedModel`."""

from __future__ import annotations

import hashlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _collectives, _keras_compat

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

    Any size is accepted: a batch that the replicas do not divide is split
    as evenly as `tf.distribute` can (e.g. 15 as 8 and 7 on 2 replicas), and
    the built-in steps are exact on it (`_steps.train_step` reweights each
    replica's loss by its share; metrics and predictions count rows).

    Raises:
        ValueError/TypeError: both sizes given, or a non-positive size.
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
        return batch_size
    return _KERAS_DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)


def static_batch_size(x) -> int | None:
    """The fixed global batch of a `tf.data.Dataset`, when its spec says it."""
    if not isinstance(x, tf.data.Dataset):
        return None
    leaves = tf.nest.flatten(x.element_spec)
    if not leaves or not hasattr(leaves[0], "shape"):
        return None
    shape = leaves[0].shape
    return int(shape[0]) if shape.rank and shape[0] is not None else None


def batches_split_evenly(
    replicas: int, global_batch: int | None, num_samples: int | None
) -> bool:
    """True when every batch, the last included, splits evenly over the replicas.

    Provable for arrays (known sample count and batch) and for datasets with
    a fixed batch size; anything else may end with an uneven batch.
    """
    if replicas == 1:
        return True
    if not global_batch or global_batch % replicas:
        return False
    if num_samples is None:
        return True  # a dataset whose every batch has this fixed size
    return (num_samples % global_batch) % replicas == 0


def is_array_structure(value) -> bool:
    leaves = tf.nest.flatten(value)
    return bool(leaves) and all(
        isinstance(v, (np.ndarray, tf.Tensor)) for v in leaves
    )


class DataCursor:
    """Where `fit` stands in its training input.

    `created` counts the iterators fit created on the input in this process
    and `consumed` the batches trained from the newest one. `persistent` is
    True when Keras keeps one iterator across epochs (`steps_per_epoch`
    given).

    A pass's order is positioned by `advance_to`, in one of three ways:

    - keras_dist's own shuffled array input (`array_dataset`) orders pass
      `created` by a function of the seed and that number alone (`passes`,
      a host variable the input pipeline reads when a pass begins): any
      pass is reached in constant time, no iterator made.
    - A `tf.data.Dataset` (`undistributed`): a seeded shuffle that
      reshuffles each pass takes the next draw of its seed generator when
      an iterator is made, on the dataset or on the distributed dataset
      made from it (they share the generator). Iterators are made and
      dropped on the dataset itself: ~3 ms each, against ~75-175 ms for a
      distributed iterator (measured with 2 replicas).
    - Otherwise (a `DistributedDataset` given to fit) on `dataset`, the
      distributed input itself.

    An input whose order does not depend on the pass (unshuffled arrays,
    arrays in Keras' own order, a dataset without a seeded reshuffle:
    `reorders` False) is positioned by the count alone.
    """

    def __init__(self, kind: str, persistent: bool):
        self.kind = kind  # "arrays", "dataset" or "other"
        self.persistent = persistent
        self.created = 0
        self.consumed = 0
        self.dataset = None
        self.undistributed = None
        self.passes = None
        self.reorders = kind != "arrays"

    def pass_number(self) -> tf.Variable:
        """The variable the input pipeline reads its pass number from."""
        if self.passes is None:
            self.passes = _keras_compat.host_counter()
            self.passes.assign(self.created)
        return self.passes

    def on_iterator_created(self) -> None:
        self.created += 1
        self.consumed = 0
        if self.passes is not None:
            self.passes.assign(self.created)

    def advance_to(self, created: int) -> bool:
        """Positions the input as after `created` iterators (False: past)."""
        if self.created > created:
            return False
        if self.passes is not None or not self.reorders:
            self.created = created
            if self.passes is not None:
                self.passes.assign(created)
            return True
        source = self.undistributed if self.undistributed is not None else self.dataset
        if source is None:
            return self.created == created
        while self.created < created:
            iter(source)
            self.on_iterator_created()
        return True


def input_kind(x) -> str:
    if is_array_structure(x):
        return "arrays"
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        return "dataset"
    return "other"


def num_samples(x) -> int:
    return int(tf.nest.flatten(x)[0].shape[0])


def array_dataset(strategy, x, y, sample_weight, batch_size, shuffle, seed, order=None,
                  cursor=None):
    """Turns in-memory arrays into a dataset with a reproducible order.

    Each pass is shuffled with `seed` and the pass's number
    (`shuffled_indices`), so a resumed run positioned at that pass sees the
    same order; or, given `order` (the sample
    indices in Keras' order, `_keras_compat.keras_shuffle_order`), every
    pass takes them in that order. Under `MultiWorkerMirroredStrategy`
    each worker keeps its own share of every global batch (auto-shard policy
    DATA), which is exact because every worker uses the agreed seed (or
    order).

    `cursor` (a `DataCursor`): with `seed`, each pass's order is drawn from
    the seed and the pass's number (`shuffled_indices`), so a resumed run
    reaches any pass without replaying the ones before.

    Keras' own adapter is kept (None is returned) for unshuffled arrays on
    one worker, and for non-array inputs. Keras 3.15's adapter draws the same
    permutation every epoch once `keras.utils.set_random_seed` is called
    (that one is `order`: the run one device gives), and a different,
    unrecorded one per worker otherwise.
    """
    multi_worker = _collectives.is_multi_worker(strategy)
    if not shuffle and not multi_worker:
        return None
    if shuffle == "batch":
        if multi_worker:
            raise ValueError(
                'shuffle="batch" is not supported under multi-worker '
                'training. Received: shuffle="batch". Use shuffle=True.'
            )
        return None
    data = (x,) if y is None else (x, y)
    if sample_weight is not None:
        data = (x, y, sample_weight)
    if not is_array_structure(data):
        return None
    samples = num_samples(x)
    # As Keras' array adapter does: lists become tuples, else `Dataset.map`
    # would stack a list of same-shaped arrays into one tensor.
    tensors = tf.nest.map_structure(
        tf.convert_to_tensor, keras.tree.lists_to_tuples(data)
    )
    indices = tf.data.Dataset.range(samples)
    if order is not None:
        indices = tf.data.Dataset.from_tensor_slices(tf.constant(order, tf.int64))
    elif shuffle:
        indices = shuffled_indices(samples, seed, cursor)
    dataset = indices.batch(batch_size).map(
        lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), tensors),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def shuffled_indices(samples: int, seed: int, cursor: DataCursor | None) -> tf.data.Dataset:
    """Every sample index once, in pass `cursor.created`'s order.

    The order is a function of `seed` and the pass number alone (Philox,
    stateless), the same on every worker and in every process; the pass
    number is read when the pass's first batch is made. Without a cursor
    (nothing counts the passes), a seeded shuffle that reshuffles each pass.
    """
    if cursor is None:
        # The agreed seed alone: a worker's own global seed left out.
        with _keras_compat.without_global_seed():
            return tf.data.Dataset.range(samples).shuffle(
                samples, seed=seed, reshuffle_each_iteration=True
            )
    passes = cursor.pass_number()
    seed = tf.constant(seed, tf.int64)

    def order(_):
        return tf.random.experimental.stateless_shuffle(
            tf.range(samples, dtype=tf.int64),
            seed=tf.stack([seed, passes.read_value()]),
            alg="philox",
        )

    return tf.data.Dataset.from_tensors(0).map(order).unbatch()


# -- Python-made batches ------------------------------------------------------
#
# Under a strategy with several replicas, TensorFlow 2.21 can write into the
# memory of a NumPy batch that a generator or a `keras.utils.PyDataset`
# returns (measured: the targets array a PyDataset slices from was changed by
# plain Keras' fit on MirroredStrategy, so a later fit on it trains on
# corrupted data). Such batches are copied before TensorFlow sees them.


def _copy_batch(batch):
    return tf.nest.map_structure(
        lambda v: np.array(v, copy=True) if isinstance(v, np.ndarray) else v,
        batch,
    )


class _CopyingPyDataset(keras.utils.PyDataset):
    """A `PyDataset` whose batches are copies of the wrapped one's."""

    def __init__(self, inner):
        super().__init__(
            workers=inner.workers,
            use_multiprocessing=inner.use_multiprocessing,
            max_queue_size=inner.max_queue_size,
        )
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    @property
    def num_batches(self):
        return self.inner.num_batches

    def __getitem__(self, index):
        return _copy_batch(self.inner[index])

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def _copying_generator(generator):
    for batch in generator:
        yield _copy_batch(batch)


def protect_python_batches(strategy: tf.distribute.Strategy, x):
    """Wraps a generator or `PyDataset` so that its batches are copies."""
    if strategy.num_replicas_in_sync < 2:
        return x
    if isinstance(x, keras.utils.PyDataset):
        return _CopyingPyDataset(x)
    if inspect.isgenerator(x):
        return _copying_generator(x)
    return x


# Arrays up to this size are hashed whole; larger ones by evenly spaced rows
# (a backup's run identity must not cost a pass over tens of GB per fit).
_HASHED_WHOLE_BYTES = 256 << 20
_SAMPLED_ROWS = 4096


def fingerprint(x, y=None, sample_weight=None) -> dict | None:
    """What identifies a fit's training data across processes and restarts.

    In-memory arrays: their shapes, dtypes and a digest of their values
    (whole up to 256 MiB per array, else 4096 evenly spaced rows). A
    `tf.data.Dataset`: its element spec and cardinality (its values are not
    read: that would consume a pass, and a shuffled pipeline differs from
    run to run). None for other inputs (generators, `PyDataset`s).
    Returns `{"kind", "shapes", "digest"}`; equal data gives equal dicts.
    """
    digest = hashlib.blake2b(digest_size=16)
    if is_array_structure(x):
        parts = [part for part in (x, y, sample_weight) if part is not None]
        shapes = []
        for leaf in tf.nest.flatten(parts):
            array = np.asarray(leaf)
            shapes.append(f"{tuple(array.shape)} {array.dtype}")
            digest.update(shapes[-1].encode())
            if array.ndim and array.nbytes > _HASHED_WHOLE_BYTES:
                rows = np.linspace(0, len(array) - 1, _SAMPLED_ROWS).astype(np.int64)
                array = array[rows]
            if array.dtype == object:
                digest.update(repr(array.tolist()).encode())
            else:
                digest.update(np.ascontiguousarray(array).tobytes())
        return {"kind": "arrays", "shapes": ", ".join(shapes), "digest": digest.hexdigest()}
    if isinstance(x, tf.data.Dataset):
        spec = repr(x.element_spec)
        cardinality = int(x.cardinality())
        shapes = f"{spec}, cardinality {cardinality}"
        digest.update(shapes.encode())
        return {"kind": "dataset", "shapes": shapes, "digest": digest.hexdigest()}
    return None


def shuffled_input(session, x, y, sample_weight, batch_size, shuffle, data_strategy=None):
    """A fit's array input as a dataset shuffled with the agreed (or resumed)
    seed, its passes counted on `session.cursor` (exact mid-epoch resume).

    The seed is agreed between `session.strategy`'s workers (or a
    `ProcessGroup`'s processes); the dataset is made for `data_strategy`
    (default: `session.strategy`), which decides whether each worker keeps
    its share of a batch. Returns `(x, y, sample_weight, dataset)`;
    `dataset` is None (and the input unchanged) when Keras keeps the input.
    """
    cursor = session.cursor
    if cursor.kind != "arrays":
        return x, y, sample_weight, None
    seed = order = None
    if shuffle and shuffle != "batch":
        # With TensorFlow's global seed set (on every worker), Keras'
        # own order: one device's run is reproduced exactly.
        global_seed = _collectives.agreed_global_seed(
            session.strategy, _keras_compat.tensorflow_global_seed()
        )
        if global_seed is not None:
            order = _keras_compat.keras_shuffle_order(num_samples(x))
        else:
            seed = session.resume.seed if session.resume is not None else None
            seed = seed or _collectives.agreed_seed(session.strategy)
    dataset = array_dataset(
        data_strategy or session.strategy, x, y, sample_weight, batch_size, shuffle, seed,
        order, cursor=cursor,
    )
    if dataset is None and shuffle:
        cursor.kind = "other"  # Keras' own, unrecorded shuffle
    cursor.seed = seed
    if dataset is None:
        return x, y, sample_weight, None
    return dataset, None, None, dataset


def split_validation(arrays, validation_split):
    """Keras' `validation_split` of `(x, y, sample_weight)` arrays: the last
    fraction of the samples. Returns `(train, validation)` tuples."""
    n = int(tf.nest.flatten(arrays[0])[0].shape[0])
    split_at = int(n * (1.0 - validation_split))

    def head(t):
        return None if t is None else t[:split_at]

    def tail(t):
        return None if t is None else t[split_at:]

    train = tuple(tf.nest.map_structure(head, a) if a is not None else None for a in arrays)
    val = tuple(tf.nest.map_structure(tail, a) if a is not None else None for a in arrays)
    if val[2] is None:
        val = val[:2]
    return train, val
