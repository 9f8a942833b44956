"""Keras' epoch iterators made lean: iterators created on first use and
counted, torn down on a release thread (joined at exit, forgotten in a
forked child), tf.data graphs inspected for Python ops, partial-batch
handling off for evenly split input.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers.data_adapters import array_data_adapter as keras_array_adapter
from keras.src.trainers.data_adapters import (
    tf_dataset_adapter as keras_tf_dataset_adapter,
)
from tensorflow.python.eager import context as tf_context

from keras_dist._keras_compat.distribute import is_multi_worker


class _LazyIterator:
    """An iterator over a `DistributedDataset`, created on first use.

    Keras' epoch iterator creates the next epoch's iterator at the end of
    every epoch and, without `steps_per_epoch`, creates another at the start
    of the next one, dropping the first: under multi-worker training each
    costs ~70 ms to create and more to tear down (its prefetch threads have
    started). Created lazily, an unused one costs nothing, and `cursor`
    (if any) counts the iterators actually created (each consumes one draw
    of a seeded shuffle), which is what a resumed run replays.

    `background_release`: the iterator, once dropped, is torn down on a
    background thread (see `_LazyDataset`); otherwise where it is dropped,
    as Keras does.
    """

    def __init__(self, dataset, cursor, background_release):
        self._dataset = dataset
        self._cursor = cursor
        self._background_release = background_release
        self._iterator = None

    def release(self) -> None:
        """Tears the real iterator down now (the call that used it ended)."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None and self._background_release:
            _release_later(iterator)

    def materialize(self):
        if self._iterator is None:
            if self._cursor is not None:
                self._cursor.on_iterator_created()
            self._iterator = iter(self._dataset)
        return self._iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.materialize())

    def __del__(self):
        if "_iterator" in self.__dict__:  # fully constructed (set last)
            self.release()

    def __getattr__(self, name):
        return getattr(self.materialize(), name)


_RELEASE_QUEUE: "queue.SimpleQueue | None" = None


_RELEASE_DONE = object()


_RELEASE_CLOSED = False  # set at exit: later releases happen in place


def _release_later(iterator) -> None:
    """Drops the last reference to `iterator` on a background thread.

    The thread is joined at exit (a teardown cut short by interpreter
    shutdown aborts the process).
    """
    global _RELEASE_QUEUE
    if _RELEASE_CLOSED or sys.is_finalizing():
        # At exit: dropped here (no thread can start while Python ends; a
        # start then blocks forever).
        return
    if _RELEASE_QUEUE is None:
        _RELEASE_QUEUE = queue.SimpleQueue()

        def release(pending=_RELEASE_QUEUE):
            while True:
                item = pending.get()
                if item is _RELEASE_DONE:
                    return
                if isinstance(item, threading.Event):
                    item.set()  # wait_for_released_iterators
                del item

        thread = threading.Thread(
            target=release, name="keras_dist-iterator-release", daemon=True
        )
        thread.start()

        def finish(pending=_RELEASE_QUEUE):
            global _RELEASE_CLOSED
            _RELEASE_CLOSED = True
            pending.put(_RELEASE_DONE)
            thread.join(timeout=60)

        atexit.register(finish)
    _RELEASE_QUEUE.put(iterator)


def _forget_release_thread() -> None:
    global _RELEASE_QUEUE
    _RELEASE_QUEUE = None  # a forked child starts its own thread when needed


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_release_thread)


def wait_for_released_iterators(timeout: float = 300.0) -> bool:
    """Waits until every iterator handed to the release thread is released.

    Returns False if `timeout` seconds passed first.
    """
    if _RELEASE_QUEUE is None:
        return True
    done = threading.Event()
    _RELEASE_QUEUE.put(done)
    return done.wait(timeout)


def materialize(iterator):
    """The real iterator behind one `fit` hands its train function."""
    if isinstance(iterator, _LazyIterator):
        return iterator.materialize()
    return iterator


class _LazyDataset:
    """Stands in for a `DistributedDataset` Keras iterates: lazy iterators.

    `background_release`: tear down dropped iterators on a background thread.
    Under multi-worker training, tearing down a distributed iterator that a
    train function used blocks for 1-6 s (measured at every epoch
    boundary); off the training thread, training goes on. Only for input
    that TensorFlow alone produces (`_tensorflow_fed`): the teardown holds
    Python's lock while it waits for the input's prefetch thread, and a
    prefetch thread that calls Python (a `PyDataset`, a generator,
    `py_function`) waits for that lock: the release thread would hang
    forever (and abort the process at exit). Such iterators are torn down
    where Keras drops them, as in Keras.
    """

    def __init__(self, dataset, made, cursor=None, background_release=False, lazy=True):
        self._dataset = dataset
        self._made = made  # a WeakSet: the iterators handed out by this call
        self._cursor = cursor
        self._background_release = background_release
        self._lazy = lazy

    def __iter__(self):
        iterator = _LazyIterator(self._dataset, self._cursor, self._background_release)
        if not self._lazy:
            iterator.materialize()
        self._made.add(iterator)
        return iterator

    def __getattr__(self, name):
        return getattr(self._dataset, name)


_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _tensorflow_fed(adapter) -> bool:
    """Whether TensorFlow alone produces an input's batches (no Python call).

    Arrays, and `tf.data` pipelines without `from_generator` or
    `py_function` anywhere (keras_dist's own array input is one by the time
    Keras sees it).
    """
    if isinstance(adapter, keras_array_adapter.ArrayDataAdapter):
        return True
    if not isinstance(adapter, keras_tf_dataset_adapter.TFDatasetAdapter):
        return False  # a PyDataset, a generator, a torch or grain loader
    for dataset in _datasets_of(adapter.get_tf_dataset()):
        for value in vars(dataset).values():
            # A transformation's function (map, flat_map, filter, ...).
            function = getattr(value, "function", None)
            graph = getattr(function, "graph", None)
            if graph is not None:
                if any(t.dtype == tf.variant for t in function.captured_inputs):
                    return False  # captures a dataset built outside: unknown
                definition = graph.as_graph_def()
                ops = {node.op for node in definition.node}
                for function in definition.library.function:
                    ops.update(node.op for node in function.node_def)
                if ops & _PYTHON_OPS:
                    return False
    return True


def _datasets_of(dataset):
    """Every `tf.data.Dataset` in a pipeline, `dataset` first."""
    seen, pending = set(), [dataset]
    while pending:
        dataset = pending.pop()
        if id(dataset) in seen:
            continue
        seen.add(id(dataset))
        yield dataset
        pending.extend(dataset._inputs())


def _reorders_each_pass(adapter) -> bool:
    """Whether the input a Keras data adapter holds reorders each pass."""
    if not isinstance(adapter, keras_tf_dataset_adapter.TFDatasetAdapter):
        return False
    return reorders_each_pass(adapter.get_tf_dataset())


def reorders_each_pass(pipeline: tf.data.Dataset) -> bool:
    """Whether a dataset's order depends on how many iterators were made.

    A seeded `shuffle` that reshuffles each pass, a seeded
    `Dataset.random` or `sample_from_datasets` that rerandomizes each pass:
    each new iterator takes the next draw of the dataset's seed generator,
    created or not used. (Unseeded, every pass is random anyway.)
    """
    for dataset in _datasets_of(pipeline):
        if not (getattr(dataset, "_reshuffle_each_iteration", False)
                or getattr(dataset, "_rerandomize", False)):
            continue
        seeds = [tf.get_static_value(getattr(dataset, name, None))
                 for name in ("_seed", "_seed2")]
        if any(seed is None or int(seed) != 0 for seed in seeds):
            return True
    return False


@contextlib.contextmanager
def lean_epoch_iterators(cursor=None, full_batches: bool = False,
                         background_release: bool | None = None,
                         lazy: bool | None = None, own_input: bool = False):
    """Keras' epoch iterators without their per-epoch and per-step waste.

    While open, every `TFEpochIterator` Keras makes (the input of `fit`,
    `evaluate`, `predict`, and `fit`'s validation data) hands out iterators
    created on first use and released on a background thread
    (`_LazyIterator`, `_LazyDataset`). The first one made is the call's
    own input:

    - `cursor` (optional) counts the iterators created on it. The order of
      a seeded shuffle (`Dataset.shuffle(seed=...)`) depends on how many
      iterators were created on the dataset before; counting them lets a
      resumed run create the same number before it trains.
    - `full_batches=True` declares that every worker gets the same number
      of batches, each split evenly over the replicas (keras_dist's own
      array input, `_data.batches_split_evenly`): it is then distributed
      without partial-batch handling, which under multi-worker training
      costs one cross-worker all-reduce per step ("has any worker data
      left?", `input_lib._calculate_replicas_with_values`).

    - `background_release`: whether dropped iterators are torn down on the
      release thread (input TensorFlow alone produces only, see
      `_LazyDataset`). None: under multi-worker training. True also serves
      a sharded model: after its DTensor steps, tearing down an epoch's
      iterator blocked for 100-200 ms (50-650 ms per fit call).
    - `lazy=False`: every iterator Keras asks for is created at once, as in
      Keras (its spare ones included). None: so for an input whose order
      depends on how many iterators were created on it before (a pipeline
      that reshuffles each pass with a seed, `_reorders_each_pass`), where
      skipping Keras' spare iterator would train other orders than Keras;
      lazily otherwise.
    - `own_input=True`: the call's input is keras_dist's own array input
      (`_data.array_dataset`), ordered by the count of iterators created on
      it (`cursor`), not by Keras' count: created lazily.

    When the call ends, normally or by an exception, every iterator it made
    that is still alive is torn down. An exception raised through Keras'
    `fit` keeps its frames, and so its iterators, in a reference cycle that
    only a later garbage collection frees, inside whatever runs then (the
    next trial, the next fit); and the teardown of an autotuned `tf.data`
    iterator that has lived for minutes can block for up to 60 s
    (TensorFlow's autotuning thread can miss its cancellation and sleep out
    its optimization period, which grows to 60 s). Torn down when the call
    ends, it is as young as the call.
    """
    original = keras_tf_trainer.TFEpochIterator.__init__
    seen = []
    made = weakref.WeakSet()

    def init(self, *args, **kwargs):
        first = not seen
        seen.append(True)
        strategy = kwargs.get("distribute_strategy") or tf.distribute.get_strategy()
        with _without_partial_batches(strategy, first and full_batches):
            original(self, *args, **kwargs)
        if isinstance(self._distributed_dataset, _LazyDataset):
            return  # made inside an enclosing call's context (nested calls)
        if first and cursor is not None:
            cursor.dataset = self._distributed_dataset
        self._distributed_dataset = _LazyDataset(
            self._distributed_dataset,
            made,
            cursor if first else None,
            background_release=(is_multi_worker(strategy) if background_release is None
                                else background_release)
            and _tensorflow_fed(self.data_adapter),
            lazy=_lazy(lazy, first and own_input, self.data_adapter),
        )

    keras_tf_trainer.TFEpochIterator.__init__ = init
    try:
        yield
    finally:
        keras_tf_trainer.TFEpochIterator.__init__ = original
        for iterator in list(made):
            iterator.release()


def tensorflow_global_seed() -> int | None:
    """TensorFlow's global seed (`keras.utils.set_random_seed`,
    `tf.random.set_seed`), or None; read without drawing an op seed."""
    return tf_context.global_seed()


@contextlib.contextmanager
def without_global_seed():
    """While open, a `tf.data` op given its own seed ignores TensorFlow's
    global seed (as if none were set: TensorFlow's default graph seed and
    the op's), so workers with different global seeds build the same
    shuffle from an agreed seed. Nothing is drawn from the seed's state.
    """
    context = tf_context.context()
    saved = context._seed
    context._seed = None
    try:
        yield
    finally:
        context._seed = saved


def keras_shuffle_order(num_samples: int) -> np.ndarray:
    """The order Keras' own array input trains `num_samples` samples in
    with `shuffle=True` while TensorFlow's global seed is set.

    Keras' array adapter draws each pass's permutation with
    `tf.random.shuffle` inside its `tf.data` pipeline, whose op seed then
    comes from the global seed and the pipeline's own graph: every pass and
    every `fit` call draws the same permutation, in any process with that
    seed. Read from Keras' own adapter over the sample indices, once per
    sample count and seed (30-80 ms; a read-only array).
    """
    return _keras_shuffle_order(int(num_samples), tensorflow_global_seed())


@functools.lru_cache(maxsize=8)
def _keras_shuffle_order(num_samples: int, seed) -> np.ndarray:
    order = _draw_keras_shuffle_order(num_samples)
    order.flags.writeable = False
    return order


def _draw_keras_shuffle_order(num_samples: int) -> np.ndarray:
    adapter = keras_array_adapter.ArrayDataAdapter(
        np.arange(num_samples, dtype="int64"), batch_size=max(num_samples, 1), shuffle=True
    )
    for batch in adapter.get_tf_dataset().take(1):
        return batch.numpy()
    return np.zeros((0,), "int64")


def _lazy(lazy: bool | None, own_input: bool, adapter) -> bool:
    if lazy is not None:
        return lazy
    return own_input or not _reorders_each_pass(adapter)


_PARTIAL_BATCHES = "experimental_enable_get_next_as_optional"


@contextlib.contextmanager
def _without_partial_batches(strategy, active: bool):
    """Distributes datasets without partial-batch handling while open."""
    extended = strategy.extended
    if not active or not getattr(extended, _PARTIAL_BATCHES, False):
        yield
        return
    setattr(extended, _PARTIAL_BATCHES, False)
    try:
        yield
    finally:
        setattr(extended, _PARTIAL_BATCHES, True)


INTERNALS = {
    "keras.src.backend.tensorflow.trainer": ("TFEpochIterator",),
    "keras.src.backend.tensorflow.trainer.TFEpochIterator (source)": (
        "_distributed_dataset",
    ),
    "tensorflow.python.distribute.collective_all_reduce_strategy (source)": (
        "experimental_enable_get_next_as_optional",
    ),
    "tensorflow.python.distribute.input_lib (source)": (
        "experimental_enable_get_next_as_optional",
        "_calculate_replicas_with_values",
    ),
    "keras.src.trainers.data_adapters.array_data_adapter": ("ArrayDataAdapter",),
    "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter": (
        "get_tf_dataset",
    ),
    "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter (source)": (
        "tf.random.shuffle",
    ),
    "tensorflow.python.eager.context": ("global_seed",),
    "tensorflow.python.eager.context.Context (source)": ("_seed",),
    "keras.src.trainers.data_adapters.tf_dataset_adapter": ("TFDatasetAdapter",),
    "tensorflow.python.data.ops.dataset_ops.DatasetV2": ("_inputs",),
    "tensorflow.python.data.ops.shuffle_op (source)": (
        "_reshuffle_each_iteration", "_seed", "_seed2",
    ),
    "tensorflow.python.data.ops.random_op (source)": ("_rerandomize", "_seed", "_seed2"),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
