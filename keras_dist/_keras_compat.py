"""Every touch point of keras_dist on Keras internals lives in this module.

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

import contextlib
import types
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.models.functional import Functional  # noqa: F401 (re-exported)
from keras.src.models.model import functional_init_arguments  # noqa: F401 (re-exported)

from keras_dist import _liveness

TESTED_KERAS_VERSIONS = ("3.15",)

if not keras.__version__.startswith(TESTED_KERAS_VERSIONS):  # pragma: no cover
    warnings.warn(
        f"keras_dist is tested with Keras {', '.join(TESTED_KERAS_VERSIONS)}; "
        f"found Keras {keras.__version__}. Distributed training may misbehave.",
        stacklevel=2,
    )


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


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
        return values[0] if values else s

    return tf.nest.map_structure(local, spec)


def symbolic_build(model, iterator=None, data_batch=None) -> None:
    """`TensorFlowTrainer._maybe_symbolic_build` without the reduce (fix 1).

    Keras only reads the shapes and dtypes of the batch, so the input's
    element spec stands in for it: no batch is read (Keras reads one, a
    collective under multi-worker training, then restarts the iterator).
    """
    strategy = model._distribute_strategy
    if strategy is None:
        return
    if iterator is not None:
        data_batch = _replica_spec(iterator)
        if data_batch is None:
            for _, _, it in iterator:
                data_batch = first_replica_batch(strategy, next(it))
                break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def reduce_per_replica(values, strategy, reduction: str):
    """Keras' `reduce_per_replica` with scalar-safe multi-worker means (fix 2)."""
    if reduction in ("auto", "mean") and is_multi_worker(strategy):
        return tf.nest.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values
        )
    return keras_tf_trainer.reduce_per_replica(values, strategy, reduction)


def make_function(model, step_function, before_input=None):
    """Builds a train/test function; a replacement for `_make_function`.

    `before_input`, if given, is called in cross-replica context before each
    step reads its input and returns tensors that the read waits for.
    """
    strategy = model.distribute_strategy

    def next_input(iterator, get):
        if before_input is None:
            return get(iterator)
        with tf.control_dependencies(before_input()):
            return get(iterator)
    steps_per_execution = int(model.steps_per_execution)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, strategy, "auto")

    # Inside the multi-step loop the step is inlined: a nested tf.function
    # called from a loop branch under MirroredStrategy loses its captured
    # inputs ("You must feed a value for placeholder tensor").
    inline_step = model._autoconvert_optionals(one_step_on_data)
    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
        )
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

    def multi_step_on_iterator(iterator):
        # Fix 3: the first step raises OutOfRangeError at the end of the data
        # (Keras turns it into StopIteration); later steps stop quietly.
        outputs = inline_step(next_input(iterator, next))
        for _ in tf.range(steps_per_execution - 1):
            optional = next_input(iterator, _get_next_as_optional)
            if not optional.has_value():
                break
            outputs = inline_step(optional.get_value())
        return outputs

    if steps_per_execution == 1:

        def multi_step_on_iterator(iterator):
            return one_step_on_data(next_input(iterator, next))

    if not model.run_eagerly:
        multi_step_on_iterator = tf.function(
            multi_step_on_iterator, reduce_retracing=True
        )

    def function(iterator):
        _liveness.step_begins()  # for the launcher's hang detection
        try:
            if isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
            ):
                return multi_step_on_iterator(iterator)
            outputs = None
            for _, data in zip(range(steps_per_execution), iterator):
                outputs = one_step_on_data(data)
            return outputs
        finally:
            _liveness.step()

    return function


def _get_next_as_optional(iterator):
    return iterator.get_next_as_optional()


def iter_sublayers(model):
    """Every layer nested in `model`, at any depth."""
    return model._flatten_layers(include_self=False, recursive=True)


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


def train_step(model, data):
    """Keras' TF `train_step`, exact for uneven splits across replicas.

    Keras scales each replica's mean loss by 1/N. When a batch is split
    unevenly (the last, partial batch of an epoch), that is not the global
    mean: replica r's loss is rescaled by n_r * N / n, so the summed gradient
    equals the gradient one device computes on the whole batch.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    factor = None
    strategy = tf.distribute.get_strategy()
    context = tf.distribute.get_replica_context()
    # Skipped (no collective) when the run's batches all split evenly.
    if (
        strategy.num_replicas_in_sync > 1
        and context is not None
        and not getattr(model, "_kd_even_batches", False)
    ):
        local = tf.cast(
            tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0],
            tf.float32,
        )
        total = context.all_reduce("SUM", local)
        factor = tf.math.divide_no_nan(
            local * float(strategy.num_replicas_in_sync), total
        )
    with tf.GradientTape() as tape:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        model._loss_tracker.update_state(
            keras_loss.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(
                next(t for t in tf.nest.flatten(x) if t is not None)
            )[0],
        )
        if factor is not None:
            loss = loss * tf.cast(factor, loss.dtype)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        gradients = tape.gradient(loss, model.trainable_weights)
        monitor = getattr(model, "_kd_monitor", None)
        if monitor is not None:
            _monitor_gradients(monitor, model, gradients, factor)
        if context is not None and strategy.num_replicas_in_sync > 1:
            gradients = agree_on_finite(model.optimizer, gradients, context)
        model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _monitor_gradients(monitor, model, gradients, factor) -> None:
    """Hands `PerReplicaMetrics` the local compute end time and gradient norm."""
    present = [g for g in gradients if g is not None]
    if monitor.multi_worker:
        with tf.control_dependencies(present):
            monitor.trace_values["compute_done"] = tf.timestamp()
    if not monitor.gradient_norm:
        return
    # The gradients are of the replica's mean loss times 1/N (Keras'
    # distribution scaling), the uneven-batch factor and the loss scale.
    scale = tf.cast(model.optimizer.scale_loss(tf.ones([])), tf.float32)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        scale = scale / float(replicas)
    if factor is not None:
        scale = scale * tf.cast(factor, tf.float32)
    norm = tf.linalg.global_norm([tf.cast(g, tf.float32) for g in present])
    monitor.trace_values["grad_norm"] = tf.math.divide_no_nan(norm, scale)


_GATHER_UNSUPPORTED = (tf.bfloat16, tf.float16)


def make_predict_function(model):
    """Keras' predict function, with outputs that can be gathered (fix 4).

    Under `MultiWorkerMirroredStrategy` predictions are concatenated with a
    collective gather, which rejects bfloat16 and float16 (mixed precision).
    Such outputs are gathered as float32; `predict` casts them back.
    """
    strategy = model.distribute_strategy
    upcast = is_multi_worker(strategy)
    # A plain holder (Keras would wrap a dict set on the model for tracking).
    dtypes = types.SimpleNamespace(outputs=None)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = model.predict_step(data)
        if not upcast:
            return outputs
        dtypes.outputs = tf.nest.map_structure(lambda t: t.dtype, outputs)
        return tf.nest.map_structure(
            lambda t: tf.cast(t, tf.float32)
            if t.dtype in _GATHER_UNSUPPORTED
            else t,
            outputs,
        )

    if not model.run_eagerly and model.jit_compile:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=True
        )
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data_distributed(data):
        outputs = strategy.run(one_step_on_data, args=(data[0],))
        return reduce_per_replica(outputs, strategy, "concat")

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_data(data):
        outputs = one_step_on_data_distributed(data[:1])
        for single_step_data in data[1:]:
            step_outputs = one_step_on_data_distributed([single_step_data])
            outputs = tf.nest.map_structure(
                lambda t1, t2: keras_tf_trainer.concat([t1, t2]),
                outputs,
                step_outputs,
            )
        return outputs

    if model.steps_per_execution > 1:
        predict_function = multi_step_on_data
    else:
        predict_function = one_step_on_data_distributed
    if not model.run_eagerly:
        predict_function = tf.function(predict_function, reduce_retracing=True)

    def counted(data):
        _liveness.step_begins()  # for the launcher's hang detection
        try:
            return predict_function(data)
        finally:
            _liveness.step()

    return counted, dtypes


def restore_dtypes(outputs, dtypes):
    """Casts gathered float32 predictions back to the model's output dtypes."""
    if dtypes.outputs is None:
        return outputs
    return tf.nest.map_structure(
        lambda value, dtype: value.astype(dtype.as_numpy_dtype)
        if hasattr(value, "astype") and dtype in _GATHER_UNSUPPORTED
        else value,
        outputs,
        dtypes.outputs,
    )


# -- BackupAndRestore touch points -------------------------------------------


def set_initial_epoch(model, epoch: int | None) -> None:
    """Keras' fit reads `model._initial_epoch` after `on_train_begin`."""
    model._initial_epoch = epoch


def global_seed_variables() -> list:
    """The state of Keras' global SeedGenerator (unseeded `keras.random`)."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return [generator.state] if generator is not None else []


class _CountingDataset:
    """Stands in for the training `DistributedDataset` Keras iterates."""

    def __init__(self, dataset, cursor):
        self._dataset = dataset
        self._cursor = cursor

    def __iter__(self):
        self._cursor.on_iterator_created()
        return iter(self._dataset)

    def __getattr__(self, name):
        return getattr(self._dataset, name)


@contextlib.contextmanager
def counting_train_iterator(cursor):
    """Counts the iterators `fit` creates on its training input.

    The order of a seeded shuffle (`Dataset.shuffle(seed=...)`) depends on
    how many iterators were created on the dataset before; Keras' epoch
    iterator creates them at a version-specific rhythm. Counting them lets a
    resumed run create the same number before it trains. Only the first
    `TFEpochIterator` of the `fit` call (the training one) is counted.
    """
    if cursor.kind not in ("arrays", "dataset"):
        yield  # generators and PyDatasets cannot be positioned: nothing to count
        return
    original = keras_tf_trainer.TFEpochIterator.__init__
    seen = []

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not seen:
            seen.append(self)
            cursor.dataset = self._distributed_dataset
            self._distributed_dataset = _CountingDataset(
                self._distributed_dataset, cursor
            )

    keras_tf_trainer.TFEpochIterator.__init__ = init
    try:
        yield
    finally:
        keras_tf_trainer.TFEpochIterator.__init__ = original


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


def reset_compiled_functions(model) -> None:
    """Drops traced train/test/predict functions (they capture old storage)."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None


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
