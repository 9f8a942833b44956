"""`DistributedModel`: a `keras.Model` that trains correctly on any strategy."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import tempfile
from typing import Any

import keras
import tensorflow as tf

from keras_dist import (
    _collectives,
    _data,
    _fit_session,
    _input_checks,
    _keras_compat,
    _steps,
)
from keras_dist._keras_compat import Functional, functional_init_arguments
from keras_dist.strategy import StrategySpec, is_default, resolve_strategy, worker_info


def _scope(strategy: tf.distribute.Strategy):
    """The strategy's scope, unless one is already open.

    Read at call time: the user's own `strategy.scope()` may be open.
    """
    if tf.distribute.has_strategy() or is_default(strategy):
        return contextlib.nullcontext()
    return strategy.scope()


def _wrap_build(model) -> None:
    """Makes `model.build(...)` create its variables on the model's strategy."""
    build = model.build
    if getattr(build, "_kd_in_scope", False):
        return

    @functools.wraps(build)
    def build_in_scope(*a, **k):
        with _scope(model._kd_strategy):
            return build(*a, **k)

    build_in_scope._kd_in_scope = True
    object.__setattr__(model, "build", build_in_scope)


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedModel(keras.Model):
    """A `keras.Model` whose variables, inputs and steps follow a strategy.

    Use it where you would use `keras.Model`: as a base class for a
    subclassed model (with your own `call` and, optionally, `train_step` /
    `test_step`), or functionally as `DistributedModel(inputs, outputs)`.
    To convert an existing model, see `keras_dist.distribute`. You never open
    `strategy.scope()`: variables, the optimizer and metrics are created on
    the strategy, `fit`/`evaluate`/`predict` distribute and shard their input,
    and the Keras 3 bugs that break multi-worker training,
    `steps_per_execution > 1` with several replicas and per-replica
    `BatchNormalization` statistics are fixed.

    `batch_size` in `fit`/`evaluate`/`predict` is the global batch, as in
    Keras; `per_replica_batch_size=` sets it per replica instead. A batch
    the replicas do not divide (the last, partial batch of an epoch, or
    any size such as 15 on 2 replicas) is split as evenly as it can be: the
    built-in `train_step` reweights each replica's loss so that the update is
    the one a single device makes on that batch.

    Args:
        strategy: What to train on: `"auto"` (default), `"mirrored"`,
            `"multi_worker"`, `"tpu"`, `"default"` or a
            `tf.distribute.Strategy`; see `keras_dist.resolve_strategy`.
        sync_batch_norm: Boolean, default True. Synchronizes every
            `BatchNormalization` layer across replicas (global-batch
            statistics, identical moving statistics on every replica).
        **kwargs: Passed to `keras.Model` (e.g. `inputs`, `outputs`, `name`).

    Example:

        >>> import keras, keras_dist
        >>> inputs = keras.Input((4,))
        >>> outputs = keras.layers.Dense(1)(inputs)
        >>> model = keras_dist.DistributedModel(inputs, outputs, strategy="default")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> model.distribute_strategy.num_replicas_in_sync
        1

    Raises:
        TypeError / ValueError: for an invalid `strategy` or
            `sync_batch_norm`, and in `fit`/`evaluate`/`predict` for batch
            sizes that do not fit the replicas.
    """

    # Set by `fit` for the duration of one call (see _fit_session.py), and
    # the composition the current train function was built for.
    _kd_session = None
    _kd_step_key = None
    # (metric variables, compiled reader) for multi-worker metric results.
    _kd_metrics_result = None

    def __new__(cls, *args, **kwargs):
        # `strategy` is a runtime choice, not part of the architecture: keep
        # it out of the config Keras records for serialization.
        kwargs.pop("strategy", None)
        kwargs.pop("sync_batch_norm", None)
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            # `DistributedModel(inputs, outputs)`, or a subclass used
            # functionally (Keras' "customizing fit()" pattern).
            target = (
                DistributedFunctional
                if cls is DistributedModel
                else _functional_subclass(cls)
            )
            return keras.Model.__new__(target, *args, **kwargs)
        obj = super().__new__(cls, *args, **kwargs)
        _wrap_build(obj)
        return obj

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_kd_wrapped", False):
            return

        # A subclass may create weights in its own `__init__`: run it under
        # the scope of the strategy it asks for.
        @functools.wraps(init)
        def __init__(self, *args, **kw):
            with _scope(resolve_strategy(kw.get("strategy", "auto"))):
                init(self, *args, **kw)

        # Keras reads the signature (for auto-configs) without following
        # `__wrapped__`: give the wrapper the original's signature.
        __init__.__signature__ = inspect.signature(init)
        __init__._kd_wrapped = True
        cls.__init__ = __init__

    def __init__(
        self,
        *args,
        strategy: StrategySpec = "auto",
        sync_batch_norm: bool = True,
        **kwargs,
    ):
        if not isinstance(sync_batch_norm, bool):
            raise TypeError(
                "Invalid type for argument `sync_batch_norm`. Expected True "
                f"or False. Received: sync_batch_norm={sync_batch_norm!r}."
            )
        graph_variables, values = [], []
        if functional_init_arguments(args, kwargs):
            # Layers called on `keras.Input` made their weights already,
            # usually outside any scope: they move onto the strategy in place.
            graph_variables = _graph_variables(args, kwargs)
            values = _keras_compat.snapshot(graph_variables)
            if not isinstance(self, Functional):
                # A subclass that builds its graph in its own `__init__` and
                # calls `super().__init__(inputs, outputs)`: as Keras does for
                # `keras.Model` subclasses, the user's class becomes a
                # functional one; keras_dist's own classes stay as they are.
                _make_functional(type(self))
        resolved = resolve_strategy(strategy)
        _keras_compat.move_onto(resolved, graph_variables, values=values)
        # Set before Keras' __init__, which may build (and so read it).
        object.__setattr__(self, "_kd_strategy", resolved)
        with _scope(resolved):
            super().__init__(*args, **kwargs)
        self._kd_sync_batch_norm = sync_batch_norm
        _keras_compat.set_model_strategy(self, None if is_default(resolved) else resolved)

    # -- strategy-aware plumbing -------------------------------------------

    def __call__(self, *args, **kwargs):
        with _scope(self._kd_strategy):
            return super().__call__(*args, **kwargs)

    def _kd_prepare_layers(self) -> None:
        if self._kd_strategy.num_replicas_in_sync < 2:
            return
        for layer in _keras_compat.iter_sublayers(self):
            if isinstance(layer, keras.layers.BatchNormalization) and self._kd_sync_batch_norm:
                _keras_compat.synchronize_batch_norm(layer)
            elif isinstance(layer, keras.layers.Dropout):
                # Each replica draws its rows of the one-device mask.
                _keras_compat.replica_invariant_dropout(layer)
            elif isinstance(layer, _keras_compat.NOISE_LAYERS):
                # Each replica draws its rows of the one-device noise.
                _keras_compat.replica_invariant_noise(layer)

    def _kd_adopt(self, obj):
        """Moves a Keras object made outside the strategy onto it, in place.

        The object itself is kept (custom optimizers and metrics need no
        config round trip); its variables, and an optimizer's state
        (iterations, slots), move onto the strategy with their values.
        """
        strategy = self._kd_strategy
        if is_default(strategy):
            return obj
        if isinstance(obj, keras.optimizers.Optimizer):
            if not _keras_compat.optimizer_on_strategy(obj, strategy):
                _keras_compat.move_onto(
                    strategy, _keras_compat.optimizer_variables(obj), optimizer=obj
                )
            return obj
        if isinstance(obj, keras.metrics.Metric):
            _keras_compat.move_onto(strategy, obj.variables)
            return obj
        if isinstance(obj, (list, tuple)):
            for o in obj:
                self._kd_adopt(o)
            return obj
        if isinstance(obj, dict):
            for o in obj.values():
                self._kd_adopt(o)
            return obj
        return obj

    def compile(
        self,
        optimizer="rmsprop",
        loss=None,
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly=False,
        steps_per_execution=1,
        jit_compile="auto",
        auto_scale_loss=True,
    ):
        with _scope(self._kd_strategy):
            if isinstance(optimizer, str):
                optimizer = keras.optimizers.get(optimizer)
            super().compile(
                optimizer=self._kd_adopt(optimizer),
                loss=loss,
                loss_weights=loss_weights,
                metrics=self._kd_adopt(metrics),
                weighted_metrics=self._kd_adopt(weighted_metrics),
                run_eagerly=run_eagerly,
                steps_per_execution=steps_per_execution,
                jit_compile=jit_compile,
                auto_scale_loss=auto_scale_loss,
            )
        self._kd_prepare_layers()

    def build_from_config(self, config):
        with _scope(self._kd_strategy):
            super().build_from_config(config)
            if not self.built and config and config.get("input_shape"):
                # Keras' build() of a subclassed model creates its weights but
                # leaves it unbuilt, so loading weights into it (keras-tuner's
                # best models, Hyperband's continued trials) fails: call it once.
                self(keras.tree.map_shape_structure(
                    lambda shape: keras.ops.zeros([1 if d is None else d for d in shape]),
                    config["input_shape"],
                ))

    def compile_from_config(self, config):
        # Keras skips this for models that override `compile`; ours keeps
        # Keras' meaning, so compile as Keras would.
        with _scope(self._kd_strategy):
            config = keras.saving.deserialize_keras_object(config)
            self.compile(**config)
            if self.optimizer is not None and self.built:
                self.optimizer.build(self.trainable_variables)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        # In a custom step: this replica's share of the global mean loss on
        # any split, logged as one device's value where the step logs it
        # (`_steps.unscaling_update_state`, set up with the step functions).
        return _steps.share_of_global_loss(loss, x, y_pred)

    def _kd_unscale_logged_losses(self):
        for metric in self.metrics:
            _steps.unscaling_update_state(metric)

    def train_step(self, data):
        session = self._kd_session
        if session is None:
            return _steps.train_step(self, data)
        return _steps.train_step(
            self,
            data,
            even_batches=session.even_batches,
            gradient_monitor=session.gradient_monitor(),
        )

    def make_train_function(self, force=False):
        # The one place the train function is composed: the train step, the
        # step wrappers the fit session's callbacks registered, and the
        # even-batch flag (see keras_dist/_fit_session.py).
        session = self._kd_session
        key = None if session is None else session.step_key()
        if self.train_function is not None and not force and key == self._kd_step_key:
            return self.train_function
        self._kd_prepare_layers()
        step, before_input = (
            (self.train_step, None) if session is None else session.compose(self.train_step)
        )
        self._kd_step_key = key
        self._kd_unscale_logged_losses()
        if session is not None:
            step = _steps.evenly_split_step(step, session.even_batches)
        self.train_function = _steps.make_function(self, step, before_input=before_input)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        self._kd_prepare_layers()
        self._kd_unscale_logged_losses()
        step = self.test_step
        if type(self).test_step is keras.Model.test_step:  # not the user's own
            step = _steps.keras_own_step(step)
        self.test_function = _steps.make_function(self, step)
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function
        self.predict_function, self._kd_predict_dtypes = (
            _steps.make_predict_function(self)
        )
        return self.predict_function

    def get_metrics_result(self):
        # Under multi-worker training every metric variable read all-reduces
        # (one eager collective each, ~25 ms apiece on two CPU workers, at
        # every epoch end): read them all in one compiled call instead, when
        # every metric is one of Keras' own (a user's `result()` may use
        # NumPy or Python values that a graph cannot run).
        strategy = self._kd_strategy
        if (
            not _collectives.is_multi_worker(strategy)
            or tf.inside_function()
            or not _keras_compat.keras_metrics_only(self.metrics)
        ):
            return super().get_metrics_result()
        key = tuple(id(v) for v in self.metrics_variables)
        cached = self._kd_metrics_result
        if cached is None or cached[0] != key:
            get = super().get_metrics_result
            cached = (key, tf.function(get, autograph=False))
            object.__setattr__(self, "_kd_metrics_result", cached)  # untracked
        return cached[1]()

    def _get_metrics_result_or_logs(self, logs):
        # _keras_compat fix 7: the keys compared flattened.
        metric_logs = self.get_metrics_result()
        if isinstance(logs, dict) and set(_steps.log_keys(logs)) == set(metric_logs):
            return metric_logs
        return logs

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # A pass over the model that one device does not make (it builds
        # while tracing its first step): what it warns is shown now, and
        # not again when that first step is traced (see `_steps._warn_once`).
        with _steps.warnings_shown_once(self):
            _keras_compat.symbolic_build(self, iterator=iterator, data_batch=data_batch)

    # -- fit / evaluate / predict ------------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
        *,
        per_replica_batch_size: int | None = None,
    ):
        """`keras.Model.fit`, plus `per_replica_batch_size=` (keyword-only).

        `batch_size` is the global batch. Under multi-worker training every
        worker must call `fit` with the same arguments; each keeps its own
        share of every global batch.
        """
        _input_checks.check_trains_here("fit")
        strategy = self._kd_strategy
        multi_worker = _collectives.is_multi_worker(strategy)
        _input_checks.check_fit_arguments(epochs, initial_epoch, validation_split)
        _input_checks.check_no_missing_inputs(multi_worker, x)
        _input_checks.check_inputs(self, x, y, sample_weight)
        if isinstance(validation_data, (tuple, list)):
            validation = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
            _input_checks.check_no_missing_inputs(
                multi_worker, validation[0], prefix="validation_data's "
            )
            _input_checks.check_inputs(self, *validation, prefix="validation_data's ")
        batch_size = _data.global_batch_size(
            strategy, x, batch_size, per_replica_batch_size
        )
        x = _data.protect_python_batches(strategy, x)
        if validation_data is not None and not isinstance(validation_data, (tuple, list)):
            validation_data = _data.protect_python_batches(strategy, validation_data)
        if validation_batch_size is not None:
            # Keras uses it for in-memory validation data only.
            _data.global_batch_size(
                strategy, None, validation_batch_size, None, "validation_batch_size"
            )
        if validation_split and validation_data is None and _data.is_array_structure(x):
            (x, y, sample_weight), validation_data = _data.split_validation(
                (x, y, sample_weight), validation_split
            )
            validation_split = 0.0
        session = self._new_session(callbacks, x, batch_size, steps_per_epoch,
                                    (x, y, sample_weight))
        try:
            # Callbacks set up now: a backup to resume from gives the seed.
            session.set_up()
            x, y, sample_weight, dataset = _data.shuffled_input(
                session, x, y, sample_weight, batch_size, shuffle
            )
            # In-memory validation data is batched as Keras batches it: by
            # `validation_batch_size`, else fit's `batch_size` (also when the
            # training arrays became a dataset; a loss summed per batch
            # logs another number with another batch size).
            validation_batch_size = validation_batch_size or batch_size
            if dataset is not None:
                # Shuffled already, with a seed every worker agreed on.
                batch_size, shuffle = None, False
            # A backup's epoch is set by BackupAndRestore's on_train_begin
            # (Keras' loop reads it then), after it read the backup's data:
            # a damaged one gives way to the previous, of another epoch.
            if validation_data is not None:
                validation_data = self._kd_eval_dataset(
                    validation_data, validation_batch_size or 32
                )
            counted = session.track_input(x)
            self._kd_session = session
            # keras_dist's own array input gives every worker the same
            # number of batches; split evenly, they need no per-step check
            # for data left on other workers.
            full_batches = dataset is not None and session.even_batches
            with _scope(strategy), _keras_compat.lean_epoch_iterators(
                counted, full_batches=full_batches, own_input=dataset is not None
            ):
                return super().fit(
                    x=x,
                    y=y,
                    batch_size=batch_size,
                    epochs=epochs,
                    verbose=self._kd_verbose(verbose),
                    callbacks=_collectives.callbacks_for_this_worker(strategy, callbacks),
                    validation_split=validation_split,
                    validation_data=validation_data,
                    shuffle=shuffle,
                    class_weight=class_weight,
                    sample_weight=sample_weight,
                    initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch,
                    validation_steps=validation_steps,
                    validation_batch_size=validation_batch_size,
                    validation_freq=validation_freq,
                )
        finally:
            self._kd_session = None
            session.tear_down()

    def _new_session(self, callbacks, x, batch_size, steps_per_epoch, training_data):
        """The fit session, with what the input tells before any callback runs."""
        strategy = self._kd_strategy
        session = _fit_session.FitSession(
            self,
            strategy,
            callbacks,
            custom_train_step=type(self).train_step is not DistributedModel.train_step,
        )
        session.describe_input(x, batch_size, steps_per_epoch, training_data)
        session.even_batches = _data.batches_split_evenly(
            strategy.num_replicas_in_sync, session.batch_size,
            _data.num_samples(x) if _data.is_array_structure(x) else None,
        )
        return session

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        _input_checks.check_trains_here("train_on_batch")
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      class_weight=class_weight, return_dict=return_dict)

    def predict_on_batch(self, x):
        """`keras.Model.predict_on_batch`: the batch is split over the replicas.

        (Keras' own hands every replica the whole batch, so N replicas
        return N copies of each prediction.)
        """
        replicas = self._kd_strategy.num_replicas_in_sync
        if replicas == 1 or not _data.is_array_structure(x):
            return super().predict_on_batch(x)
        # One batch of every row, split as any batch is.
        return self.predict(x, batch_size=max(_data.num_samples(x), 1), verbose=0)

    def _kd_verbose(self, verbose):
        """Progress output comes from the chief only."""
        return verbose if worker_info(self._kd_strategy).is_chief else 0

    def _kd_eval_dataset(self, data, batch_size):
        if not _collectives.is_multi_worker(self._kd_strategy):
            return data
        if not isinstance(data, (tuple, list)):
            return data
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(data))
        dataset = _data.array_dataset(
            self._kd_strategy, x, y, sample_weight, batch_size, False, None
        )
        return data if dataset is None else dataset

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        *,
        per_replica_batch_size: int | None = None,
        **kwargs,
    ):
        """`keras.Model.evaluate`, plus `per_replica_batch_size=`."""
        strategy = self._kd_strategy
        full_batches = False
        if not kwargs.get("_use_cached_eval_dataset", False):
            _input_checks.check_no_missing_inputs(_collectives.is_multi_worker(strategy), x)
            _input_checks.check_inputs(self, x, y, sample_weight)
        x = _data.protect_python_batches(strategy, x)
        if not kwargs.get("_use_cached_eval_dataset", False):
            batch_size = _data.global_batch_size(
                strategy, x, batch_size, per_replica_batch_size
            )
            dataset = _data.array_dataset(
                strategy, x, y, sample_weight, batch_size, False, None
            )
            if dataset is not None:
                full_batches = _data.batches_split_evenly(
                    strategy.num_replicas_in_sync,
                    batch_size,
                    _data.num_samples(x),
                )
                x, y, sample_weight, batch_size = dataset, None, None, None
        with _scope(strategy), _keras_compat.lean_epoch_iterators(
            full_batches=full_batches
        ):
            return super().evaluate(
                x=x,
                y=y,
                batch_size=batch_size,
                verbose=self._kd_verbose(verbose),
                sample_weight=sample_weight,
                steps=steps,
                callbacks=_collectives.callbacks_for_this_worker(strategy, callbacks),
                return_dict=return_dict,
                **kwargs,
            )

    def predict(
        self,
        x,
        batch_size=None,
        verbose="auto",
        steps=None,
        callbacks=None,
        *,
        per_replica_batch_size: int | None = None,
    ):
        """`keras.Model.predict`, plus `per_replica_batch_size=`.

        Predictions come back in input order, on every worker.
        """
        strategy = self._kd_strategy
        _input_checks.check_no_missing_inputs(_collectives.is_multi_worker(strategy), x)
        _input_checks.check_arrays(x)
        batch_size = _data.global_batch_size(
            strategy, x, batch_size, per_replica_batch_size
        )
        x = _data.protect_python_batches(strategy, x)
        dataset = _data.array_dataset(strategy, x, None, None, batch_size, False, None)
        if dataset is not None:
            x, batch_size = dataset, None
        with _scope(strategy), _keras_compat.lean_epoch_iterators():
            outputs = super().predict(
                x,
                batch_size=batch_size,
                verbose=self._kd_verbose(verbose),
                steps=steps,
                callbacks=_collectives.callbacks_for_this_worker(strategy, callbacks),
            )
        return _steps.restore_dtypes(outputs, self._kd_predict_dtypes)

    # -- saving ------------------------------------------------------------

    def _kd_chief_only(self, write, filepath):
        """Every worker writes (collectives stay aligned); only the chief keeps.

        Under multi-worker training the workers then wait for each other, so
        that when `save` returns on any worker the chief's file is complete
        (a worker may load it on its next line); a failed save raises on
        every worker.
        """
        strategy = self._kd_strategy
        chief = worker_info(strategy).is_chief
        scratch = None if chief else tempfile.mkdtemp(prefix="keras_dist_worker_")
        error = None
        try:
            target = filepath if chief else os.path.join(
                scratch, os.path.basename(str(filepath))
            )
            result = write(target)
        except Exception as e:  # re-raised below, after the barrier
            error = e
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if _collectives.is_multi_worker(strategy):
            failed = _collectives.agree_sum(strategy, [error is not None])[0]
            if failed and error is None:
                raise RuntimeError(
                    f"Saving {str(filepath)!r} failed on {failed} other "
                    "worker(s) (their output says why); nothing new was "
                    "kept."
                )
        if error is not None:
            raise error
        return result

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """`keras.Model.save`; under multi-worker only the chief's file is kept.

        Every worker must call it. Under multi-worker training it returns on
        each worker only once the chief's file is complete.
        """
        return self._kd_chief_only(
            lambda path: super(DistributedModel, self).save(
                path, overwrite=overwrite, zipped=zipped, **kwargs
            ),
            filepath,
        )

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """`keras.Model.save_weights`; only the chief's file is kept.

        Every worker must call it; it returns once the chief's file is
        complete.
        """
        return self._kd_chief_only(
            lambda path: super(DistributedModel, self).save_weights(
                path, overwrite=overwrite, max_shard_size=max_shard_size
            ),
            filepath,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("strategy", None)
        if not self._kd_sync_batch_norm:
            config["sync_batch_norm"] = False
        return config


def _graph_variables(args, kwargs) -> list:
    """The variables of the layers between a functional model's inputs and outputs."""
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[0]
    if "outputs" in kwargs:
        outputs = kwargs["outputs"]
    else:
        outputs = args[1] if len(args) > 1 else args[0]
    graph = keras.Model(inputs=inputs, outputs=outputs)
    return _keras_compat.unique_variables(graph.variables)


def _model_state(model: keras.Model) -> list:
    """Every variable a model owns: layers, optimizer, compiled metrics."""
    variables = list(model.variables) + list(model.metrics_variables)
    if _optimizer(model) is not None:
        variables += _keras_compat.optimizer_variables(model.optimizer)
    return _keras_compat.unique_variables(variables)


def _optimizer(model: keras.Model):
    """The model's Keras optimizer, or None (also for an `optimizer`
    attribute that holds something else: a model may set one, as Keras'
    own does not forbid)."""
    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None


class _KerasModelConfig:
    """Keras' config round trip of `_kd_keras_class`, plus `sync_batch_norm`."""

    _kd_keras_class: type

    def get_config(self) -> dict[str, Any]:
        config = self._kd_keras_class.get_config(self)
        if not self._kd_sync_batch_norm:
            config["sync_batch_norm"] = False
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        sync = config.pop("sync_batch_norm", True)
        # Keras builds each layer from its build config as it deserializes
        # it: under the scope, so that its variables land on the strategy.
        with _scope(resolve_strategy("auto")):
            model = cls._kd_keras_class.from_config.__func__(
                cls, config, custom_objects
            )
        model._kd_sync_batch_norm = sync
        return model


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedFunctional(_KerasModelConfig, DistributedModel, Functional):
    """What `DistributedModel(inputs, outputs)` builds."""

    _kd_keras_class = Functional


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedSequential(_KerasModelConfig, DistributedModel, keras.Sequential):
    """What `distribute()` makes of a `keras.Sequential` model."""

    _kd_keras_class = keras.Sequential


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedWrapper(DistributedModel):
    """Models saved by keras_dist 0.1's `distribute()` (loading only)."""

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.wrapped_model = model

    def call(self, inputs, training=None):
        return self.wrapped_model(inputs, training=training)

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.wrapped_model),
            "sync_batch_norm": self._kd_sync_batch_norm,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        strategy = resolve_strategy(config.pop("strategy", "auto"))
        with _scope(strategy):
            model = keras.saving.deserialize_keras_object(
                config.pop("model"), custom_objects=custom_objects
            )
        return cls(model, strategy=strategy, **config)


_DISTRIBUTED_CLASSES: dict = {}


def _subclass(cls, bases: tuple) -> type:
    """A class named like the user's `cls`, whose MRO adds keras_dist's."""
    if (cls, bases) not in _DISTRIBUTED_CLASSES:
        new = type(
            cls.__name__,
            bases,
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        # Saved models name the user's class, so they load as written.
        _keras_compat.alias_registered_name(new, cls)
        _DISTRIBUTED_CLASSES[(cls, bases)] = new
    return _DISTRIBUTED_CLASSES[(cls, bases)]


def _functional_subclass(cls) -> type:
    """`cls` (a DistributedModel subclass) used as `cls(inputs, outputs)`."""
    return _subclass(cls, (cls, DistributedFunctional))


def _make_functional(cls: type) -> type:
    """Puts `DistributedFunctional` where `DistributedModel` is in `cls`'s bases.

    Keras' `Model.__init__` with functional arguments rewrites the bases of
    every class between the user's and `keras.Model` to reach `Functional`
    (`inject_functional_model_class`), which would make `DistributedModel`
    itself functional for the rest of the process. keras_dist does the
    same rewrite first, only on the user's classes, so that Keras' one is
    never reached (the instance is then a `Functional`).
    """
    if cls is DistributedModel:
        return DistributedFunctional
    if not issubclass(cls, DistributedModel) or issubclass(cls, Functional):
        return cls
    cls.__bases__ = tuple(_make_functional(base) for base in cls.__bases__)
    return cls


def _distributed_class(cls) -> type:
    """The class `distribute()` gives a model of class `cls`.

    Keras' own classes map to registered keras_dist classes; a user's class
    gets a subclass that puts the user's methods first (their `train_step`,
    `compile`, ... win, and their `super()` calls reach keras_dist's).
    """
    if issubclass(cls, DistributedModel):
        return cls
    if cls is Functional:
        return DistributedFunctional
    if cls is keras.Sequential:
        return DistributedSequential
    return _subclass(cls, (cls, DistributedModel))


def distribute(
    model: keras.Model,
    strategy: StrategySpec = "auto",
    *,
    sync_batch_norm: bool = True,
) -> DistributedModel:
    """Makes an existing Keras model a `DistributedModel` on `strategy`, in place.

    Works for any `keras.Model`: Sequential, functional (dict and nested
    inputs and outputs), subclassed with any constructor, custom layers
    without `get_config`, `Lambda` layers, nested models; built or not,
    compiled or not. Nothing is re-created from a config: the same model
    object comes back, with the same layers, now also a
    `DistributedModel`, and the storage of each of its variables (weights,
    optimizer state, metrics) re-created under the strategy's scope with its
    current value. Under `MultiWorkerMirroredStrategy` the chief's values
    are broadcast, so every worker starts from identical weights. A
    compiled model stays compiled, with its optimizer state. Your own
    `train_step`, `test_step` and `compile` overrides keep working.

    Args:
        model: A `keras.Model`.
        strategy: See `keras_dist.resolve_strategy`; default `"auto"` (the
            strategy whose scope is open, if any).
        sync_batch_norm: Boolean, default True; see `DistributedModel`.

    Returns:
        `model` itself, now a `DistributedModel`.

    Example:

        >>> import keras, keras_dist
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> dist = keras_dist.distribute(model, strategy="default")
        >>> dist is model, isinstance(model, keras_dist.DistributedModel)
        (True, True)
        >>> [w.shape for w in dist.get_weights()]
        [(3, 2), (2,)]

    Raises:
        TypeError: if `model` is not a `keras.Model`, or `sync_batch_norm`
            is not a boolean.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Invalid type for argument `model`. Expected a keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}."
        )
    if not isinstance(sync_batch_norm, bool):
        raise TypeError(
            "Invalid type for argument `sync_batch_norm`. Expected True "
            f"or False. Received: sync_batch_norm={sync_batch_norm!r}."
        )
    variables = _model_state(model)
    # Values first: creating a MultiWorkerMirroredStrategy after TensorFlow
    # started makes existing tensors unreadable.
    values = _keras_compat.snapshot(variables)
    seed_state = _keras_compat.global_seed_variables()
    seed_values = _keras_compat.snapshot(seed_state)
    resolved = resolve_strategy(strategy)
    _keras_compat.restore_unreadable(seed_state, seed_values)
    model.__class__ = _distributed_class(type(model))
    object.__setattr__(model, "_kd_strategy", resolved)
    model._kd_sync_batch_norm = sync_batch_norm
    _keras_compat.set_model_strategy(model, None if is_default(resolved) else resolved)
    _wrap_build(model)
    _keras_compat.move_onto(
        resolved, variables, optimizer=_optimizer(model), values=values
    )
    _fit_session.reset_compiled_functions(model)
    model._kd_prepare_layers()
    return model
