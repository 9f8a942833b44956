"""keras_dist's own step code: the train, test and predict functions.

`DistributedModel` builds its compiled functions here. They follow Keras'
TensorFlow trainer (`keras/src/backend/tensorflow/trainer.py`) and fix what
breaks under distribution (see `_keras_compat` for each Keras bug); every
private Keras symbol they need is reached through `_keras_compat`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
import weakref

import keras
import tensorflow as tf

from keras_dist import _collectives, _input_checks, _keras_compat, _liveness


def make_function(model, step_function, before_input=None):
    """Builds a train/test function; a replacement for `_make_function`.

    `before_input`, if given, is called in cross-replica context before each
    step reads its input and returns tensors that the read waits for.
    """
    strategy = model.distribute_strategy
    check_labels = _input_checks.label_range_check(model)
    if check_labels is not None:
        unchecked = step_function

        def step_function(data):
            return unchecked(check_labels(data))

    def next_input(iterator, get):
        if before_input is None:
            return get(iterator)
        with tf.control_dependencies(before_input()):
            return get(iterator)
    steps_per_execution = int(model.steps_per_execution)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return _keras_compat.reduce_per_replica(outputs, strategy, "auto")

    one_step_on_data = _warn_once(one_step_on_data, _local_replicas(strategy), model)

    # Inside the multi-step loop the step is inlined: a nested tf.function
    # called from a loop branch under MirroredStrategy loses its captured
    # inputs ("You must feed a value for placeholder tensor").
    inline_step = _keras_compat.autoconvert_optionals(model, one_step_on_data)
    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
        )
    one_step_on_data = _keras_compat.autoconvert_optionals(model, one_step_on_data)

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

    def run(iterator):
        iterator = _keras_compat.materialize(iterator)
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return multi_step_on_iterator(iterator)
        outputs = None
        for _, data in zip(range(steps_per_execution), iterator):
            outputs = one_step_on_data(data)
        return outputs

    def function(iterator):
        return _liveness.counted(run, iterator)  # for the launcher's hang detection

    return function


def _warn_once(run_step, replicas: int, model=None):
    """A cross-replica step (`data -> strategy.run(...)`) whose Python
    warnings show once, as one device's run shows them.

    A strategy traces the replica step once per local replica (in a thread
    each), so a warning a layer or a loss raises while traced came N times
    on N replicas. The replicas' warnings are collected around the whole
    step (on the calling thread: warning filters are process-wide) and each
    is shown as many times as one replica raised it. The first trace after
    a symbolic build also leaves out what that build showed already
    (`warnings_shown_once`).
    """

    def step(data):
        with _collected_warnings() as caught:
            outputs = run_step(data)
        shown = model.__dict__.pop("_kd_warned", None) if model is not None else None
        counts: dict = {}
        for w in caught:
            key = (str(w.message), w.category, w.filename, w.lineno)
            counts.setdefault(key, [w, 0])[1] += 1
        for (message, category, _, _), (w, count) in counts.items():
            times = max(1, count // replicas)
            if shown and (message, category) in shown:
                times -= 1
            _show(w, times)
        return outputs

    return step


@contextlib.contextmanager
def warnings_shown_once(model):
    """Shows the warnings raised inside now, and has `model`'s next traced
    step leave them out (the same pass over the model, made again)."""
    with _collected_warnings() as caught:
        yield
    for w in caught:
        _show(w)
    # Untracked by Keras (a plain attribute of the instance).
    model.__dict__["_kd_warned"] = {(str(w.message), w.category) for w in caught}


@contextlib.contextmanager
def _collected_warnings():
    """Every warning raised inside, held back (shown later with `_show`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _show(w, times: int = 1) -> None:
    """Shows a held-back warning `times` times, through the caller's filters."""
    for _ in range(times):
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _local_replicas(strategy) -> int:
    """How many replicas this process traces a replica step for."""
    if _collectives.is_multi_worker(strategy):
        return max(1, len(strategy.extended.worker_devices))
    return strategy.num_replicas_in_sync


def _get_next_as_optional(iterator):
    return iterator.get_next_as_optional()


def log_keys(logs: dict) -> list:
    """The names a step's logs show under, nested dicts flattened (as
    Keras shows `{"compile_metrics": {"mae": ...}}`: as `mae`)."""
    keys = []
    for key, value in logs.items():
        keys += log_keys(value) if isinstance(value, dict) else [key]
    return keys


# The losses `compute_loss` returned in the replica steps traced:
# {id(loss): (weak reference to it, its replica's share of the global batch)}.
_SCALED_LOSSES: dict = {}
# Flags of the replica step being traced, in the replica's thread: `active`
# while keras_dist's or Keras' own step computes its loss (it reweights and
# logs the loss itself), `even_batches` in a train step of a run whose every
# batch splits evenly.
_OWN_STEP = threading.local()


def share_of_global_loss(loss, x, y_pred):
    """This replica's share of the global batch's mean loss, from the loss
    `compute_loss` returned in a replica step of a custom `train_step`.

    Keras scales each replica's mean loss by 1/N on N replicas, so that the
    optimizer's sum of the replicas' gradients is the global batch's; when
    the replicas' shares of a batch differ (a short last batch, a size the
    replicas do not divide) that sum is not one device's gradient. Here the
    loss is reweighted by this replica's rows (n_r N / n, one scalar
    all-reduce counts them; skipped when every batch splits evenly), as
    keras_dist's own step does. The loss is also remembered, so that a step
    written as Keras' guide writes it, which logs this loss as it is
    (`metric.update_state(loss)`), logs one device's value
    (`unscaling_update_state`).
    """
    if (
        loss is None
        or getattr(_OWN_STEP, "active", False)
        or not tf.distribute.has_strategy()
        or tf.distribute.in_cross_replica_context()
        or tf.distribute.get_strategy().num_replicas_in_sync < 2
    ):
        return loss
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    share = 1.0 / replicas
    leaves = [t for t in tf.nest.flatten((y_pred, x)) if t is not None]
    if leaves and not getattr(_OWN_STEP, "even_batches", False):
        rows = tf.cast(tf.shape(leaves[0])[0], tf.float32)
        total = tf.distribute.get_replica_context().all_reduce("SUM", rows)
        share = tf.math.divide_no_nan(rows, total)
        loss = loss * tf.cast(share * replicas, loss.dtype)
    for key in [k for k, (ref, _) in _SCALED_LOSSES.items() if ref() is None]:
        del _SCALED_LOSSES[key]  # their graphs are gone
    _SCALED_LOSSES[id(loss)] = (weakref.ref(loss), share)
    return loss


def keras_own_step(step_function):
    """Keras' own step (its `test_step`), which logs the loss with weights of
    its own: `compute_loss` leaves the loss as Keras scales it there."""
    return _with_flag(step_function, "active", True)


def evenly_split_step(step_function, even_batches: bool):
    """A train step of a run whose every batch splits evenly over the
    replicas (`even_batches`): `compute_loss` then needs no count of rows."""
    return _with_flag(step_function, "even_batches", even_batches)


def _with_flag(step_function, name: str, value: bool):
    """`step_function` with `_OWN_STEP.<name>` set while it runs (traced in
    each replica's thread)."""

    def step(data):
        setattr(_OWN_STEP, name, value)
        try:
            return step_function(data)
        finally:
            setattr(_OWN_STEP, name, False)

    return step


def _share(value):
    """The replica's share if `value` is a loss `compute_loss` returned (else None)."""
    ref, share = _SCALED_LOSSES.get(id(value), (lambda: None, None))
    return share if ref() is value else None


def unscaling_update_state(metric) -> None:
    """Has `metric.update_state(loss)` log one device's value for a loss
    `compute_loss` returned in this replica step.

    Such a loss (this replica's mean times its share of the global batch) is
    logged as the replica's mean weighted by its share: the metric then
    gains, per step, the global batch's mean loss with weight 1, as on one
    device. Any other call is passed on unchanged. Set on the metric object
    (its class is shared).
    """
    if "_kd_update_state_of" in metric.__dict__:
        return
    original = metric.update_state

    @functools.wraps(original)
    def update_state(*args, **kwargs):
        share = _share(args[0]) if len(args) == 1 and not kwargs else None
        if share is None:
            return original(*args, **kwargs)
        share = tf.cast(share, args[0].dtype)
        return original(tf.math.divide_no_nan(args[0], share), sample_weight=share)

    # Straight into the object's __dict__: past Keras' attribute tracking.
    metric.__dict__.update(_kd_update_state_of=original, update_state=update_state)


def train_step(model, data, *, even_batches: bool = False, gradient_monitor=None):
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
    rows = contextlib.nullcontext()
    # Skipped (no collective) when the run's batches all split evenly.
    if (
        strategy.num_replicas_in_sync > 1
        and context is not None
        and not even_batches
    ):
        local = tf.cast(
            tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0],
            tf.float32,
        )
        # Every replica's rows (one collective): their total, and where this
        # replica's start in the global batch (Dropout's and the noise
        # layers' draws, see `_keras_compat.rows_start_at`).
        replicas = strategy.num_replicas_in_sync
        replica = context.replica_id_in_sync_group
        counts = context.all_reduce("SUM", tf.one_hot(replica, replicas) * local)
        total = tf.reduce_sum(counts)
        before = tf.cast(tf.range(replicas) < tf.cast(replica, tf.int32), tf.float32)
        rows = _keras_compat.rows_start_at(tf.cast(tf.reduce_sum(counts * before), tf.int64))
        factor = tf.math.divide_no_nan(local * float(replicas), total)
    with rows, tf.GradientTape() as tape:
        if _keras_compat.call_has_training_arg(model):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        _OWN_STEP.active = True  # reweighted below, not by `compute_loss`
        try:
            loss = _keras_compat.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
        finally:
            _OWN_STEP.active = False
        _keras_compat.loss_tracker(model).update_state(
            _keras_compat.unscale_loss_for_distribution(loss),
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
        if gradient_monitor is not None:
            _monitor_gradients(gradient_monitor, model, gradients, factor)
        if context is not None and strategy.num_replicas_in_sync > 1:
            gradients = _collectives.agree_on_finite(model.optimizer, gradients, context)
        if (
            context is not None
            and strategy.num_replicas_in_sync > 1
            and getattr(model.optimizer, "gradient_accumulation_steps", None)
        ):
            _apply_accumulating(context, model.optimizer, gradients, model.trainable_weights)
        else:
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.")  # noqa: B028 (as Keras)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _apply_accumulating(context, optimizer, gradients, variables) -> None:
    """`optimizer.apply_gradients` for an optimizer with
    `gradient_accumulation_steps`, from a replica step.

    Keras' accumulation chooses between "update" and "accumulate" in a
    `cond` whose update branch reaches the strategy's `merge_call`, which
    TensorFlow refuses inside a `cond` in a replica context (plain Keras
    fails on any `MirroredStrategy`). Here the replicas' gradients are
    summed first (each is already scaled by 1/N, so the sum is the global
    batch's gradient) and the optimizer applies them once, in the
    cross-replica context, where its `cond` updates every replica's copy
    alike: k accumulated steps of global batch B on N replicas make the
    update one device makes with the same optimizer on batch B.
    """
    pairs = [(g, v) for g, v in zip(gradients, variables) if g is not None]

    def apply(strategy, per_replica):
        summed = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(g, g) for g, _ in per_replica]
        )
        # Equal on every replica: one copy, applied to every replica's
        # variable by the strategy's update.
        summed = [strategy.experimental_local_results(g)[0] for g in summed]
        with _keras_compat.cross_replica_updates(strategy):
            optimizer.apply_gradients(zip(summed, [v for _, v in per_replica]))

    context.merge_call(apply, args=(pairs,))


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
    upcast = _collectives.is_multi_worker(strategy)
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
    one_step_on_data = _keras_compat.autoconvert_optionals(model, one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data_distributed(data):
        outputs = strategy.run(one_step_on_data, args=(data[0],))
        return _keras_compat.reduce_per_replica(outputs, strategy, "concat")

    one_step_on_data_distributed = _warn_once(
        one_step_on_data_distributed, _local_replicas(strategy), model
    )

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_data(data):
        outputs = one_step_on_data_distributed(data[:1])
        for single_step_data in data[1:]:
            step_outputs = one_step_on_data_distributed([single_step_data])
            outputs = tf.nest.map_structure(
                lambda t1, t2: _keras_compat.concat([t1, t2]),
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
        return _liveness.counted(predict_function, data)  # for the launcher's hang detection

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
