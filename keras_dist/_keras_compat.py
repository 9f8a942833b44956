"""Every touch point of keras_dist on Keras and TensorFlow internals.

No other module reads or writes a private Keras/TF attribute or imports
`keras.src` (tests/test_keras_compat.py enforces it, and pins each symbol
listed in `INTERNALS` and `OVERRIDDEN` at the end of this module). What is
here: accessors to private symbols, and the fixes that need them.

Keras 3's TensorFlow trainer (`keras/src/backend/tensorflow/trainer.py`) has
bugs that break distributed training; the fixes below replace the affected
pieces for `DistributedModel` only, without patching Keras globally:

1. `_maybe_symbolic_build` reduces the first batch with
   `strategy.reduce("MEAN", <nest>)`, which `MultiWorkerMirroredStrategy`
   rejects ("Attempt to convert a value (PerReplica...) to a Tensor").
   Only shapes are needed, so replica 0's local batch is used instead.
2. `reduce_per_replica` reduces scalar logs with `axis=0` under
   `MultiWorkerMirroredStrategy` ("Invalid reduction dimension 0").
   Logs are reduced with `axis=None`.
3. The `steps_per_execution > 1` loop fails with more than one replica
   ("You must feed a value for placeholder tensor", keras-team/keras#19246).
   The loop below takes the first step unconditionally and the following
   ones through `get_next_as_optional` inside an autograph `for` loop.
4. `predict` under `MultiWorkerMirroredStrategy` gathers outputs with a
   collective that rejects bfloat16/float16 (mixed precision): they are
   gathered as float32 and cast back.
5. `LossScaleOptimizer` (mixed_float16) skips or applies a step from each
   replica's local gradients; replicas are made to agree (see
   `agree_on_finite`), which also keeps MultiWorkerMirroredStrategy from
   hanging.
6. `BackupAndRestore` resumes an interrupted run: it sets the epoch Keras'
   fit starts from (`model._initial_epoch`, read after `on_train_begin`),
   saves Keras' global SeedGenerator, and counts the iterators fit creates
   on the training input (`TFEpochIterator`) so that a seeded shuffle is
   positioned exactly.

Tested against the Keras versions in `TESTED_KERAS_VERSIONS`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.models.functional import Functional  # noqa: F401 (re-exported)
from keras.src.models.model import functional_init_arguments  # noqa: F401 (re-exported)
from keras.src.random import seed_generator as keras_random
from keras.src.trainers.data_adapters import array_data_adapter as keras_array_adapter
from keras.src.trainers.data_adapters import (
    tf_dataset_adapter as keras_tf_dataset_adapter,
)

TESTED_KERAS_VERSIONS = ("3.15",)

if not keras.__version__.startswith(TESTED_KERAS_VERSIONS):  # pragma: no cover
    warnings.warn(
        f"keras_dist is tested with Keras {', '.join(TESTED_KERAS_VERSIONS)}; "
        f"found Keras {keras.__version__}. Distributed training may misbehave.",
        stacklevel=2,
    )


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """A MultiWorkerMirroredStrategy's own test for several processes."""
    return strategy.extended._in_multi_worker_mode()


def _is_multi_worker(strategy) -> bool:
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


def _replica_spec(iterator):
    """The spec of one replica's batch of a Keras epoch iterator, or None."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def local(s):
        values = getattr(s, "_value_specs", None)  # PerReplicaSpec
        s = values[0] if values else s
        # A `None` entry of the input structure (an optional input): Keras
        # builds from `None` itself.
        return None if type(s).__name__ == "NoneTensorSpec" else s

    return tf.nest.map_structure(local, spec)


def symbolic_build(model, iterator=None, data_batch=None) -> None:
    """`TensorFlowTrainer._maybe_symbolic_build` without the reduce (fix 1).

    Keras only reads the shapes and dtypes of the batch, so the input's
    element spec stands in for it: no batch is read (Keras reads one, a
    collective under multi-worker training, then restarts the iterator).
    """
    strategy = model._distribute_strategy
    if strategy is None:
        # Keras defers the build to the first step here; a backup restored
        # in `on_train_begin` needs the variables before it. The input's
        # spec stands in for a batch (no iterator is made).
        if data_batch is None and iterator is not None:
            data_batch = _adapter_batch_spec(getattr(iterator, "data_adapter", None))
        if data_batch is not None:
            model._symbolic_build(data_batch=data_batch)
        return
    if iterator is not None:
        data_batch = _replica_spec(iterator)
        if data_batch is None:
            for _, _, it in iterator:
                data_batch = first_replica_batch(strategy, next(it))
                break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def clone_layer(layer):
    """A new layer like `layer` (as `keras.models.clone_model` makes one),
    except that a `Lambda` keeps its Python function object: its config
    round trip is refused in safe mode, and would lose closures anyway."""
    if isinstance(layer, keras.layers.Lambda):
        return keras.layers.Lambda(
            layer.function,
            output_shape=layer._output_shape,
            mask=layer.mask,
            arguments=layer.arguments,
            name=layer.name,
            dtype=layer.dtype_policy,
        )
    return layer.__class__.from_config(layer.get_config())


def _adapter_batch_spec(adapter):
    """The spec of a batch of arrays or of a `tf.data` pipeline, read without
    making a dataset or an iterator (either could change what a seeded
    program draws); None for other input (built at the first step)."""
    if isinstance(adapter, keras_tf_dataset_adapter.TFDatasetAdapter):
        return adapter._dataset.element_spec
    if isinstance(adapter, keras_array_adapter.ArrayDataAdapter):
        leaves = [a for a in tf.nest.flatten(adapter._inputs) if a is not None]
        if not all(isinstance(a, (np.ndarray, tf.Tensor)) for a in leaves):
            return None  # e.g. a DataFrame: Keras converts it per batch
        return tf.nest.map_structure(
            lambda a: None if a is None else tf.TensorSpec(
                (None,) + tuple(a.shape[1:]), tf.as_dtype(a.dtype)
            ),
            adapter._inputs,
        )
    return None


def reduce_per_replica(values, strategy, reduction: str):
    """Keras' `reduce_per_replica` with scalar-safe multi-worker means (fix 2)."""
    if reduction in ("auto", "mean") and _is_multi_worker(strategy):
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


# -- TensorFlow runtime and strategies ---------------------------------------


def eager_runtime_started() -> bool:
    """Whether TensorFlow's eager runtime exists (collectives are fixed then)."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_collectives(cluster_spec, task_type: str, task_id: int) -> bool:
    """What `MultiWorkerMirroredStrategy.__init__` configures, done early.

    The values are the ones `_initialize_multi_worker` passes
    (`tensorflow/python/distribute/collective_all_reduce_strategy.py`), so
    the strategy's own call finds them already set. Returns False when the
    cluster spec is unusable (the strategy's creation reports it).
    """
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2,
    )
    from tensorflow.python.eager import context

    try:
        spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    except (ValueError, RuntimeError, KeyError):
        return False
    ctx = context.context()
    ctx.configure_collective_ops(
        collective_leader=multi_worker_util.collective_leader(
            spec, task_type, task_id
        ),
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{task_type}/task:{task_id}",),
    )
    if ctx.coordination_service is None and task_type in ("chief", "worker"):
        ctx.configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(spec),
            # TensorFlow's default (10 s) failed a 2-worker job once on a
            # 2-core machine under load: the leader's own heartbeat came
            # late. `keras-dist launch` watches its workers itself.
            heartbeat_timeout_in_ms=60_000,
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=spec.num_tasks(job)
                )
                for job in ("chief", "worker")
                if job in spec.jobs
            ],
        )
    return True


def join_cluster_at_startup(cluster_spec, task_type: str, task_id: int) -> None:
    """Makes TensorFlow's runtime start as this task of the cluster.

    `MultiWorkerMirroredStrategy.__init__` enables collective ops with a
    server definition (`_initialize_multi_worker`); when the runtime is
    already running, TensorFlow renames the local devices from
    `/job:localhost` to `/job:<task_type>` and every dataset, tensor or
    variable made before becomes unusable ("/job:localhost/... unknown
    device"). Given the same definition before the runtime starts, the
    runtime starts (at the script's first TensorFlow call, after any device
    configuration) with the job's device names, so objects made before the
    strategy keep working. The definition is the strategy's own: the
    context's configuration with `_update_config_proto`'s changes.
    """
    from tensorflow.core.protobuf import rewriter_config_pb2, tensorflow_server_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    ctx = context.context()
    config = ctx.config
    rewrite = config.graph_options.rewrite_options
    rewrite.scoped_allocator_optimization = rewriter_config_pb2.RewriterConfig.ON
    del rewrite.scoped_allocator_opts.enable_op[:]
    rewrite.scoped_allocator_opts.enable_op.append("CollectiveReduce")
    config.experimental.collective_group_leader = multi_worker_util.collective_leader(
        spec, task_type, task_id
    )
    del config.device_filters[:]
    config.device_filters.append(f"/job:{task_type}/task:{task_id}")
    ctx.enable_collective_ops(
        tensorflow_server_pb2.ServerDef(
            cluster=spec.as_cluster_def(),
            default_session_config=config,
            job_name=task_type,
            task_index=task_id,
            protocol="grpc",
        )
    )
    # This process's server is started (at its runtime's start): every
    # MultiWorkerMirroredStrategy made in it, keras_dist's or the user's
    # own, uses it as TensorFlow does for a strategy whose server already
    # started (`_std_server_started`), instead of updating it with a second
    # `enable_collective_ops`, which races with peers resolving their first
    # collective group (a 2-worker job was seen to hang in its first
    # broadcast). The Python health check stays off, as TensorFlow turns it
    # off whenever the coordination service (configured above) runs.
    from tensorflow.python.distribute import collective_all_reduce_strategy

    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    extended._std_server_started = True
    extended._enable_check_health = False


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


def synchronize_batch_norm(layer) -> None:
    """Global-batch statistics for a `BatchNormalization` layer, computed stably.

    Keras' `synchronized=True` all-reduces the sum and the sum of squares and
    takes E[x^2] - E[x]^2: in float32 that cancels when a channel's mean is
    large against its spread (measured: weights 3.9e-5 away from one device
    after a short fit, where one device's two-pass variance is exact). Here:
    the sum and count in one all-reduce, the global mean, then the sum of
    squared deviations from it in a second (Keras uses three).
    """
    layer.synchronized = True  # what Keras reads elsewhere (and for masks)
    if getattr(layer, "_kd_stable_moments", False):
        return
    keras_moments = layer._moments

    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if (
            mask is not None
            or context is None
            or context.num_replicas_in_sync < 2
        ):
            return keras_moments(inputs, mask)
        axes = list(layer._reduction_axes)
        total = tf.reduce_sum(inputs, axis=axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        summed = context.all_reduce(
            "SUM", tf.concat([tf.reshape(total, [-1]), count[None]], axis=0)
        )
        count = summed[-1]
        mean = tf.reshape(tf.math.divide_no_nan(summed[:-1], count), tf.shape(total))
        deviations = tf.reduce_sum(
            tf.square(inputs - tf.reshape(mean, _broadcast_shape(inputs, axes))), axis=axes
        )
        variance = tf.math.divide_no_nan(context.all_reduce("SUM", deviations), count)
        return mean, variance

    layer._moments = moments
    layer._kd_stable_moments = True


def replica_invariant_dropout(layer) -> None:
    """Makes a `Dropout` layer (or a subclass: spatial dropout) draw, on each
    of N replicas, its slice of the mask one device draws for the global
    batch, so that N replicas train as one device does, Dropout included.

    Keras' dropout is TensorFlow's stateless dropout, seeded from the
    layer's `SeedGenerator` (the same state on every replica). Its mask is
    Philox noise over the noise shape; replica r's rows of the global mask
    start `r * rows * inner` elements in, and Philox makes block k of any
    draw directly: each replica draws only its own rows (no N-times larger
    tensor). Rows follow the replica order in which a global batch is split.
    """
    if getattr(layer, "_kd_invariant_dropout", False):
        return
    keras_call = layer.call

    def call(inputs, training=False):
        context = tf.distribute.get_replica_context()
        if (
            not training
            or not layer.rate > 0
            or context is None
            or context.num_replicas_in_sync < 2
        ):
            return keras_call(inputs, training=training)
        spatial = hasattr(layer, "_get_noise_shape")  # one draw per sample and channel
        noise_shape = layer._get_noise_shape(inputs) if spatial else layer.noise_shape
        if not spatial and noise_shape is not None and noise_shape[0] is not None:
            return keras_call(inputs, training=training)  # one mask for every row
        return _dropout_rows(inputs, layer.rate, noise_shape,
                             keras_random.draw_seed(layer.seed_generator), context)

    layer.call = call
    layer._kd_invariant_dropout = True


def _dropout_rows(inputs, rate, noise_shape, seed, context):
    """`tf.nn.experimental.stateless_dropout` of the global batch, this
    replica's rows only (see `replica_invariant_dropout`)."""
    x = tf.convert_to_tensor(inputs)
    seed = keras_tf_random._cast_seed(seed)
    shape = tf.shape(x)
    noise = [shape[0]] + [  # this replica's rows, then the noise shape's other axes
        shape[i] if noise_shape is None or noise_shape[i] is None else noise_shape[i]
        for i in range(1, x.shape.rank)
    ]
    rows = tf.cast(noise[0], tf.int64)
    inner = tf.reduce_prod(tf.cast(tf.stack(noise[1:]), tf.int64)) if len(noise) > 1 else (
        tf.constant(1, tf.int64))
    start = tf.cast(context.replica_id_in_sync_group, tf.int64) * rows * inner
    per_block = 2 if x.dtype.size > 4 else 4  # Philox: 4 x 32 bits per counter step
    block, lane = start // per_block, start % per_block
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    counter = tf.bitcast(tf.bitcast(counter, tf.int64) + tf.stack(
        [block, tf.constant(0, tf.int64)]), tf.uint64)
    uniform = tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.reshape(rows * inner + lane, [1]), key=key, counter=counter,
        alg=tf.raw_ops.StatelessRandomGetAlg(), dtype=x.dtype,
    )[lane:]
    uniform = tf.reshape(uniform, tf.stack([tf.cast(n, tf.int32) for n in noise]))
    kept = x * tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype)
    return tf.where(uniform >= rate, kept, tf.zeros((), x.dtype))


def _broadcast_shape(inputs, axes):
    """The shape that broadcasts per-channel statistics against `inputs`."""
    rank = inputs.shape.rank
    shape = tf.unstack(tf.shape(inputs))
    return [1 if i in axes else shape[i] for i in range(rank)]


def forget_collectives() -> None:
    """Undoes `configure_collectives` before the runtime starts (a process
    that turns out to run multi-client DTensor, which configures its own)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx._collective_leader = None
    ctx._collective_scoped_allocator_enabled_ops = None
    ctx._collective_use_nccl_communication = None
    ctx._collective_device_filters = None
    ctx._coordination_service_config = None
    ctx._collective_ops_server_def = None  # join_cluster_at_startup
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    if "_std_server_started" in vars(extended):
        del extended._std_server_started
        extended._enable_check_health = True


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


def attention_projections(layer) -> dict:
    """A MultiHeadAttention layer's query/key/value/output EinsumDense layers."""
    names = {"query": "_query_dense", "key": "_key_dense",
             "value": "_value_dense", "output": "_output_dense"}
    return {k: getattr(layer, v, None) for k, v in names.items()}


# -- accessors for keras_dist's step code (`_steps.py`) ------------------------


def autoconvert_optionals(model, function):
    """Keras' wrapper that turns `tf.experimental.Optional` outputs into values."""
    return model._autoconvert_optionals(function)


def call_has_training_arg(model) -> bool:
    return model._call_has_training_arg


def compute_loss(model, **kwargs):
    """`Model._compute_loss`: the loss Keras' own train step computes."""
    return model._compute_loss(**kwargs)


def unscale_loss_for_distribution(loss):
    return keras_loss.unscale_loss_for_distribution(loss)


def concat(tensors):
    """Keras' concatenation of predict outputs (handles ragged/sparse)."""
    return keras_tf_trainer.concat(tensors)


# -- LearningRateScaler -------------------------------------------------------


def learning_rate_variable(optimizer):
    """What an optimizer reads its rate from: a variable or a schedule.

    (`optimizer.learning_rate` evaluates a schedule; the scaler needs the
    object itself, to wrap it and to put it back.)
    """
    return optimizer._learning_rate


def set_learning_rate_variable(optimizer, value) -> None:
    optimizer._learning_rate = value


def iter_sublayers(model):
    """Every layer nested in `model`, at any depth."""
    return model._flatten_layers(include_self=False, recursive=True)


# -- BackupAndRestore touch points -------------------------------------------


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


def loss_tracker(model) -> keras.metrics.Mean:
    """The `Mean` behind a compiled model's `loss` log."""
    return model._loss_tracker


def set_initial_epoch(model, epoch: int | None) -> None:
    """Keras' fit reads `model._initial_epoch` after `on_train_begin`."""
    model._initial_epoch = epoch


def global_seed_variables() -> list:
    """The state of Keras' global SeedGenerator (unseeded `keras.random`)."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
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
        iterator = self.__dict__.pop("_iterator", None)
        if iterator is not None and self.__dict__.get("_background_release"):
            _release_later(iterator)

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

    def __init__(self, dataset, cursor=None, background_release=False):
        self._dataset = dataset
        self._cursor = cursor
        self._background_release = background_release

    def __iter__(self):
        return _LazyIterator(self._dataset, self._cursor, self._background_release)

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
    seen, pending = set(), [adapter.get_tf_dataset()]
    while pending:
        dataset = pending.pop()
        if id(dataset) in seen:
            continue
        seen.add(id(dataset))
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
        pending.extend(dataset._inputs())
    return True


@contextlib.contextmanager
def lean_epoch_iterators(cursor=None, full_batches: bool = False):
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
    """
    original = keras_tf_trainer.TFEpochIterator.__init__
    seen = []

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
            cursor if first else None,
            background_release=_is_multi_worker(strategy)
            and _tensorflow_fed(self.data_adapter),
        )

    keras_tf_trainer.TFEpochIterator.__init__ = init
    try:
        yield
    finally:
        keras_tf_trainer.TFEpochIterator.__init__ = original


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


# -- moving an existing model onto a strategy, in place -----------------------


def _storage(variable):
    """The `tf.Variable` behind a Keras variable (None while deferred)."""
    return getattr(variable, "_value", None)


def on_strategy(variable, strategy: tf.distribute.Strategy) -> bool:
    """Whether a Keras variable's storage was created under `strategy`."""
    value = _storage(variable)
    if value is None:
        return True  # created on first use, under whatever scope is open then
    return getattr(value, "_distribute_strategy", None) is strategy


def unique_variables(variables) -> list:
    seen, result = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            result.append(v)
    return result


def snapshot(variables) -> list:
    """Host copies of the variables' values.

    Taken before a `MultiWorkerMirroredStrategy` is created: enabling
    collective ops after TensorFlow started makes earlier tensors unreadable
    ("Haven't set up remote eager worker").
    """
    return [np.asarray(v.value.numpy()) if _storage(v) is not None else None
            for v in variables]


def move_variables(variables, values, strategy: tf.distribute.Strategy) -> int:
    """Re-creates each Keras variable's storage under `strategy`'s scope.

    The Keras variable objects stay (layers, optimizers and metrics keep
    their references); only the `tf.Variable` behind each is replaced by one
    the strategy creates, mirrored or replicated as the strategy wants.
    Under `MultiWorkerMirroredStrategy` the new storage is initialized from
    the chief's value (TensorFlow broadcasts initial values), so every
    worker starts identical. Every worker must move the same variables in
    the same order. Returns the number of variables moved.
    """
    moved = 0
    with tf.init_scope(), strategy.scope():
        for variable, value in zip(variables, values):
            if value is None or on_strategy(variable, strategy):
                continue
            # Keras' own initialization path (TF backend `Variable._initialize`):
            # same dtype, trainability, name, aggregation and synchronization.
            variable._initialize(value)
            moved += 1
    return moved


def move_onto(strategy, variables, optimizer=None, values=None) -> None:
    """Moves variables (and the optimizer that updates them) onto `strategy`.

    `values`: host copies taken earlier (see `snapshot`); by default they
    are read now. The optimizer's updates are routed through `strategy` and
    its per-variable lookups follow the moved storage.
    """
    keys = optimizer_keys(optimizer)
    if optimizer is not None:
        set_optimizer_strategy(optimizer, strategy)
    if values is None:
        variables = [v for v in variables if not on_strategy(v, strategy)]
        values = snapshot(variables)
    move_variables(variables, values, strategy)
    rekey_optimizers(keys)


def optimizers_of(optimizer) -> list:
    """The optimizer and any optimizer it wraps (`LossScaleOptimizer`)."""
    found = []
    while optimizer is not None and optimizer not in found:
        found.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def optimizer_on_strategy(optimizer, strategy) -> bool:
    return all(
        getattr(o, "_distribution_strategy", strategy) is strategy
        for o in optimizers_of(optimizer)
    )


def optimizer_variables(optimizer) -> list:
    return unique_variables(
        v for o in optimizers_of(optimizer) for v in o.variables
    )


def set_optimizer_strategy(optimizer, strategy) -> None:
    """Points a TF-backend optimizer's updates at `strategy`.

    Keras' TF optimizer captures `tf.distribute.get_strategy()` when it is
    constructed and routes every update through it.
    """
    for o in optimizers_of(optimizer):
        if hasattr(o, "_distribution_strategy"):
            o._distribution_strategy = strategy


def restore_unreadable(variables, values) -> None:
    """Re-creates, outside any strategy, storage that became unreadable.

    Process-wide Keras state (the global SeedGenerator) made before a
    `MultiWorkerMirroredStrategy` existed cannot be read once collective ops
    are enabled; it gets fresh storage with its old value.
    """
    for variable, value in zip(variables, values):
        if value is None:
            continue
        try:
            variable.value.numpy()
        except tf.errors.InternalError:
            with tf.init_scope():
                variable._initialize(value)


def alias_registered_name(new_cls, cls) -> None:
    """Serializes `new_cls` under `cls`'s registered name (loads as `cls`)."""
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    if cls in names:
        names[new_cls] = names[cls]


def optimizer_keys(optimizer) -> list:
    """Each built optimizer's keys for its variables (taken before a move).

    Keras' TF optimizer keys its per-variable state by the `tf.Variable`
    behind each Keras variable (`_var_key`), which a move replaces.
    """
    return [
        (o, [o._var_key(v) for v in o._trainable_variables])
        for o in optimizers_of(optimizer)
        if o.built
    ]


def rekey_optimizers(saved: list) -> None:
    """Points optimizers' per-variable lookups at the moved storage."""
    for o, old in saved:
        new = [o._var_key(v) for v in o._trainable_variables]
        o._trainable_variables_indices = {k: i for i, k in enumerate(new)}
        mapping = dict(zip(old, new))
        excluded = getattr(o, "_exclude_from_weight_decay", None)
        if excluded:
            o._exclude_from_weight_decay = {mapping.get(k, k) for k in excluded}
        o._exclude_from_weight_decay_cache = {}


# -- what the tests pin ---------------------------------------------------------

OVERRIDDEN = {
    "_maybe_symbolic_build": ("keras.Model",),
}
"""Private Keras methods keras_dist's classes override (name: owners)."""

INTERNALS = {
    "keras.Model (compiled)": (
        "_autoconvert_optionals",
        "_call_has_training_arg",
        "_compute_loss",
        "_distribute_strategy",
        "_flatten_layers",
        "_loss_tracker",
        "_symbolic_build",
    ),
    "keras.optimizers.Optimizer (built)": (
        "_distribution_strategy",
        "_learning_rate",
        "_trainable_variables",
        "_trainable_variables_indices",
        "_var_key",
    ),
    "keras.src.optimizers.base_optimizer.BaseOptimizer (source)": (
        "_exclude_from_weight_decay",
        "_exclude_from_weight_decay_cache",
    ),
    "keras.Variable": ("_initialize", "_value"),
    "keras.callbacks.ModelCheckpoint (built)": (
        "_batches_seen_since_last_saving",
        "_last_batch_seen",
    ),
    "keras.layers.MultiHeadAttention (built)": (
        "_key_dense",
        "_output_dense",
        "_query_dense",
        "_value_dense",
    ),
    "keras.src.backend.tensorflow.trainer": (
        "TFEpochIterator",
        "concat",
        "reduce_per_replica",
    ),
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit (source)": (
        "_initial_epoch",
    ),
    "keras.src.backend.tensorflow.trainer.TFEpochIterator (source)": (
        "_distributed_dataset",
    ),
    "keras.src.losses.loss": ("unscale_loss_for_distribution",),
    "keras.src.backend.common.global_state": ("get_global_attribute",),
    "keras.src.saving.object_registration": ("GLOBAL_CUSTOM_NAMES",),
    "keras.src.models.functional": ("Functional",),
    # DistributedModel.__init__ does inject_functional_model_class's rewrite
    # on the user's classes only (see _make_functional).
    "keras.src.models.model": ("functional_init_arguments", "inject_functional_model_class"),
    "tensorflow.python.distribute.values.PerReplicaSpec (source)": ("_value_specs",),
    "tensorflow.python.distribute.mirrored_strategy (source)": ("_collective_key_base",),
    "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended": (
        "_in_multi_worker_mode",
    ),
    "tensorflow.python.distribute.collective_all_reduce_strategy (source)": (
        "experimental_enable_get_next_as_optional",
    ),
    "tensorflow.python.distribute.input_lib (source)": (
        "experimental_enable_get_next_as_optional",
        "_calculate_replicas_with_values",
    ),
    "tensorflow.python.eager.context.Context (source)": (
        "_context_handle",
        "_collective_ops_server_def",
        "configure_collective_ops",
        "configure_coordination_service",
        "enable_collective_ops",
    ),
    # cross_replica_updates: the switch maybe_merge_call reads.
    "tensorflow.python.distribute.merge_call_interim (source)": ("_use_merge_call",),
    # join_cluster_at_startup builds the definition the strategy builds, and
    # marks its server started.
    "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended (source)": (
        "_enable_check_health",
        "_std_server_started",
        "_update_config_proto",
        "collective_group_leader",
        "device_filters",
        "scoped_allocator_opts",
    ),
    "keras.src.layers.normalization.batch_normalization.BatchNormalization (source)": (
        "_moments",
        "_reduction_axes",
    ),
    "keras.src.layers.core.lambda_layer.Lambda (source)": ("_output_shape",),
    "keras.src.backend.tensorflow.random": ("_cast_seed",),
    "keras.src.random.seed_generator": ("draw_seed",),
    "keras.src.layers.regularization.spatial_dropout.BaseSpatialDropout (source)": (
        "_get_noise_shape",
    ),
    "keras.src.trainers.data_adapters.array_data_adapter": ("ArrayDataAdapter",),
    "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter (source)": (
        "_inputs",
    ),
    "keras.src.trainers.data_adapters.tf_dataset_adapter": ("TFDatasetAdapter",),
    "keras.src.trainers.data_adapters.tf_dataset_adapter.TFDatasetAdapter (source)": (
        "_dataset",
    ),
    "tensorflow.python.data.ops.dataset_ops.DatasetV2": ("_inputs",),
    "tensorflow.python.distribute.multi_worker_util": (
        "collective_leader",
        "coordination_leader",
        "normalize_cluster_spec",
    ),
}
"""Every private Keras/TF symbol used above, by owner, for the test that pins
them: a dotted path (module or class), a path with " (source)" (the names
occur in its source: attributes Keras sets and reads itself) or a built
object described in the test."""
