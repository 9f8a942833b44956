"""`LearningRateScaler`: scale the learning rate with the global batch."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Literal

import keras
import tensorflow as tf

from keras_dist import _fit_session, _keras_compat
from keras_dist.strategy import worker_info

Rule = Literal["linear", "sqrt", "none"]
_RULES = ("linear", "sqrt", "none")


def _check_rule(rule) -> None:
    if rule not in _RULES:
        raise ValueError(
            'Invalid value for argument `rule`. Expected one of "linear", '
            f'"sqrt" or "none". Received: rule={rule!r}'
        )


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _rule_factor(factor: float, rule: str) -> float:
    if rule == "linear":
        return float(factor)
    if rule == "sqrt":
        return math.sqrt(factor)
    return 1.0


def scale_learning_rate(
    learning_rate: float,
    scale: tf.distribute.Strategy | float,
    rule: Rule = "linear",
) -> float:
    """The learning rate for a global batch `scale` times the base batch.

    The arithmetic of `LearningRateScaler`, for code that builds its own
    optimizer or schedule: `"linear"` multiplies by the factor (Goyal et al.,
    2017), `"sqrt"` by its square root, `"none"` leaves the rate unchanged.

    Args:
        learning_rate: Float, the rate tuned for the base batch.
        scale: A `tf.distribute.Strategy` (the factor is its number of
            replicas in sync) or a positive number (global batch divided by
            the base batch).
        rule: `"linear"` (default), `"sqrt"` or `"none"`.

    Example:

        >>> import keras_dist
        >>> keras_dist.scale_learning_rate(0.1, 4)
        0.4
        >>> keras_dist.scale_learning_rate(0.1, 4, rule="sqrt")
        0.2

    Raises:
        TypeError: `learning_rate` is not a float, or `scale` is neither a
            strategy nor a number.
        ValueError: an unknown `rule`, a non-positive `scale`.
    """
    if not isinstance(learning_rate, float):
        raise TypeError(
            "Invalid type for argument `learning_rate`. Expected a float. "
            f"Received: learning_rate={learning_rate!r} of type "
            f"{type(learning_rate).__name__}. Write it as a float (e.g. 1.0)."
        )
    _check_rule(rule)
    if isinstance(scale, tf.distribute.Strategy):
        factor = float(scale.num_replicas_in_sync)
    elif _is_number(scale):
        if not scale > 0:
            raise ValueError(
                "Invalid value for argument `scale`. Expected a positive "
                f"number. Received: scale={scale!r}"
            )
        factor = float(scale)
    else:
        raise TypeError(
            "Invalid type for argument `scale`. Expected a "
            "tf.distribute.Strategy or a positive number. Received: "
            f"scale={scale!r} of type {type(scale).__name__}"
        )
    return learning_rate * _rule_factor(factor, rule)


class _Ramp:
    """The multiplier at optimizer step t: 1 -> `final`, linear over `steps`."""

    def __init__(self, final: float, steps: int):
        self.final = float(final)
        self.steps = int(steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        if self.steps <= 0:
            return tf.ones_like(step) * self.final
        progress = tf.minimum(step / float(self.steps), 1.0)
        return 1.0 + (self.final - 1.0) * progress


class _ScaledRate:
    """A float learning rate, scaled in the graph by the ramp.

    Keras reads a callable learning rate at every step. The optimizer's own
    variable keeps the unscaled rate (it is what checkpoints hold); setting
    the rate (`optimizer.learning_rate = x`, as `ReduceLROnPlateau` and
    `LearningRateScheduler` do) sets the rate in effect now, so the variable
    receives `x / multiplier`.
    """

    def __init__(self, variable, optimizer, ramp: _Ramp):
        self.variable = variable
        self.optimizer = optimizer
        self.ramp = ramp

    def __call__(self):
        multiplier = self.ramp(self.optimizer.iterations)
        return self.variable * tf.cast(multiplier, self.variable.dtype)

    def assign(self, value):
        multiplier = float(self.ramp(self.optimizer.iterations))
        self.variable.assign(float(value) / multiplier)


class _ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A user's `LearningRateSchedule`, times the ramp, per optimizer step."""

    def __init__(self, schedule, ramp: _Ramp):
        self.schedule = schedule
        self.ramp = ramp

    def __call__(self, step):
        rate = self.schedule(step)
        return rate * tf.cast(self.ramp(step), rate.dtype)

    def get_config(self):
        return self.schedule.get_config()


class _CorrectedMomentum:
    """SGD's momentum times lr(t) / lr(t - 1) while the ramp changes the rate.

    Keras' SGD keeps the learning rate inside its velocity; when the rate
    grows, the velocity still carries the old one. Scaling the momentum by
    the ratio for that step corrects it (Goyal et al., 2017, section 2.2).
    """

    def __init__(self, momentum: float, optimizer, ramp: _Ramp):
        self.momentum = momentum
        self.optimizer = optimizer
        self.ramp = ramp

    def value(self):
        step = tf.cast(self.optimizer.iterations, tf.float32)
        previous = self.ramp(tf.maximum(step - 1.0, 0.0))
        return self.momentum * self.ramp(step) / previous


tf.register_tensor_conversion_function(
    _CorrectedMomentum,
    lambda value, dtype=None, name=None, as_ref=False: tf.cast(
        value.value(), dtype or tf.float32
    ),
)


def _innermost(optimizer):
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


class LearningRateScaler(keras.callbacks.Callback):
    """Scales the learning rate with the global batch, after a gradual warmup.

    With N replicas, a data-parallel step sees N times the batch one device
    sees. Linear scaling with a gradual warmup (Goyal et al., 2017, "Accurate,
    Large Minibatch SGD") keeps the accuracy of the small-batch run: the rate
    starts at the one tuned for the base batch and grows linearly, step by
    step, to the scaled one over the warmup.

    The scaling is applied in the training graph, driven by
    `optimizer.iterations`: it works with a float learning rate and with any
    `keras.optimizers.schedules.LearningRateSchedule` (scaled per step), it
    continues exactly after `BackupAndRestore` restores a run, and a second
    `fit` never scales twice (the optimizer keeps its unscaled rate; the
    warmup covers the optimizer's first steps). Between calls to `fit` the
    optimizer is left as it was built.

    Composition: the scaler scales the rate the optimizer is built with.
    Callbacks that set the rate during `fit` (`ReduceLROnPlateau`,
    `LearningRateScheduler`) read and set the rate in effect (scaled):
    `ReduceLROnPlateau` reduces the scaled rate by its factor and the warmup
    continues from there; a `LearningRateScheduler` value is used as it is
    (compute it with `keras_dist.scale_learning_rate` to have it scaled).

    Args:
        rule: `"linear"` (default): rate times the factor; `"sqrt"`: times
            its square root; `"none"`: unscaled (warmup only to itself).
        base_batch_size: Positive int or None (default). The batch the rate
            was tuned for; the factor is then global batch / base batch.
            None: the factor is the number of replicas in sync.
        warmup_epochs: Non-negative number, default 0. Length of the warmup
            in epochs (converted to steps with the epoch's step count).
        warmup_steps: Non-negative int or None (default). Length of the warmup
            in optimizer steps; exclusive with `warmup_epochs`.
        momentum_correction: Boolean, default False. For `keras.optimizers.SGD`
            with momentum: scales the momentum by lr(t) / lr(t-1) at each step
            of the warmup, as Horovod does.
        verbose: 0 (default) or 1. With 1, the chief prints the scaling once
            and `learning_rate` is added to the logs of every batch (progress
            bar, TensorBoard with `update_freq`), not only of every epoch.

    Example:

        >>> import keras, keras_dist, numpy as np
        >>> inputs = keras.Input((3,))
        >>> model = keras_dist.DistributedModel(
        ...     inputs, keras.layers.Dense(1)(inputs), strategy="default")
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> scaler = keras_dist.callbacks.LearningRateScaler(
        ...     base_batch_size=8, warmup_steps=2)
        >>> history = model.fit(np.ones((64, 3)), np.ones((64, 1)), batch_size=32,
        ...                     epochs=1, callbacks=[scaler], verbose=0)
        >>> round(history.history["learning_rate"][0], 6)  # 0.1 x 32 / 8
        0.4

    Raises:
        ValueError / TypeError: for invalid arguments (here); at the start of
            `fit` for an integer learning rate, `warmup_epochs` with an input
            of unknown length, or `base_batch_size` when the global batch
            cannot be known.
    """

    def __init__(
        self,
        rule: Rule = "linear",
        *,
        base_batch_size: int | None = None,
        warmup_epochs: float = 0,
        warmup_steps: int | None = None,
        momentum_correction: bool = False,
        verbose: int = 0,
    ):
        super().__init__()
        _check_rule(rule)
        if base_batch_size is not None and (
            not isinstance(base_batch_size, numbers.Integral)
            or isinstance(base_batch_size, bool)
            or base_batch_size <= 0
        ):
            raise ValueError(
                "Invalid value for argument `base_batch_size`. Expected None or "
                f"a positive integer. Received: base_batch_size={base_batch_size!r}"
            )
        if not _is_number(warmup_epochs) or warmup_epochs < 0:
            raise ValueError(
                "Invalid value for argument `warmup_epochs`. Expected a "
                f"non-negative number. Received: warmup_epochs={warmup_epochs!r}"
            )
        if warmup_steps is not None and (
            not isinstance(warmup_steps, numbers.Integral)
            or isinstance(warmup_steps, bool)
            or warmup_steps < 0
        ):
            raise ValueError(
                "Invalid value for argument `warmup_steps`. Expected None or a "
                f"non-negative integer. Received: warmup_steps={warmup_steps!r}"
            )
        if warmup_steps is not None and warmup_epochs:
            raise ValueError(
                "Arguments `warmup_steps` and `warmup_epochs` are mutually "
                f"exclusive. Received: warmup_steps={warmup_steps}, "
                f"warmup_epochs={warmup_epochs}. Pass one of them."
            )
        if not isinstance(momentum_correction, bool):
            raise TypeError(
                "Invalid type for argument `momentum_correction`. Expected a "
                f"bool. Received: momentum_correction={momentum_correction!r}"
            )
        if verbose not in (0, 1) or isinstance(verbose, bool):
            raise ValueError(
                "Invalid value for argument `verbose`. Expected 0 or 1. "
                f"Received: verbose={verbose!r}"
            )
        # Configuration: survives across fit() calls. All training state
        # (the unscaled rate, the step) lives in the optimizer.
        self.rule = rule
        self.base_batch_size = base_batch_size
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.momentum_correction = momentum_correction
        self.verbose = verbose
        # Without per-step logging, nothing here needs Keras to wait for each
        # step's logs: keep its asynchronous callback dispatch.
        self.async_safe = not verbose
        # Per-run state (set when fit starts, cleared when it ends).
        self._installed = None
        self._session = None  # the DistributedModel.fit session, during one
        self.factor = None
        self.final_multiplier = None
        self.warmup_total_steps = None

    # Keras builds the callback list (set_model, then set_params) before it
    # builds the train function: installing here puts the scaled rate into
    # the graph of this fit without retracing a function built already.
    def set_params(self, params):
        super().set_params(params)
        if self.model is not None and params and "steps" in params:
            self._install(params)

    def setup_fit(self, session) -> None:
        """The fit-session hook: the global batch size comes from `fit`."""
        self._session = session
        session.add_teardown(self._end_session)

    def _end_session(self) -> None:
        self._session = None

    def _global_batch(self):
        context = self._session
        batch = getattr(context, "batch_size", None)
        dataset = getattr(context, "dataset", None)
        if batch is None and dataset is not None:
            # Batched without drop_remainder: read the first batch's size.
            for element in dataset.take(1):
                batch = int(tf.shape(tf.nest.flatten(element)[0])[0])
        if batch is None:
            raise ValueError(
                "LearningRateScaler(base_batch_size=...) needs the global batch "
                "size, which this fit does not give: use a DistributedModel "
                "(keras_dist.distribute(model)) with array input or a "
                "tf.data.Dataset batched to a fixed size, or drop "
                "base_batch_size to scale by the number of replicas. Received: "
                f"base_batch_size={self.base_batch_size}"
            )
        return int(batch)

    def _install(self, params) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "LearningRateScaler needs a compiled model with a Keras "
                f"optimizer. Received: optimizer={optimizer!r}. Call "
                "model.compile(optimizer=...) first."
            )
        optimizer = _innermost(optimizer)
        self._uninstall_stale(optimizer)
        current = _keras_compat.learning_rate_variable(optimizer)
        if isinstance(current, keras.Variable):
            if not current.dtype.startswith("float"):
                raise TypeError(
                    "LearningRateScaler needs a float learning rate. Received: "
                    f"learning_rate of dtype {current.dtype}. Build the "
                    "optimizer with a float (e.g. learning_rate=1.0)."
                )
        elif not isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                "LearningRateScaler scales a float learning rate or a "
                "keras.optimizers.schedules.LearningRateSchedule. Received: "
                f"learning_rate={current!r}. Wrap your callable in a "
                "LearningRateSchedule."
            )
        strategy = model.distribute_strategy
        # A ShardedModel's data-parallel degree is its mesh's "batch" axis.
        sharded = getattr(model, "__keras_dist_data_parallel_size__", None)
        replicas = sharded() if sharded is not None else strategy.num_replicas_in_sync
        if self.base_batch_size is None:
            factor = float(replicas)
        else:
            factor = self._global_batch() / self.base_batch_size
        steps = self.warmup_steps
        if steps is None:
            steps = 0
            if self.warmup_epochs:
                per_epoch = params.get("steps")
                if not per_epoch:
                    raise ValueError(
                        "LearningRateScaler(warmup_epochs=...) needs the number "
                        "of steps per epoch, which this input does not give "
                        f"(unknown length). Received: warmup_epochs="
                        f"{self.warmup_epochs}. Pass steps_per_epoch to fit, or "
                        "warmup_steps= instead."
                    )
                steps = int(round(self.warmup_epochs * per_epoch))
        ramp = _Ramp(_rule_factor(factor, self.rule), steps)
        installed = {"optimizer": optimizer, "rate": current, "momentum": None}
        if isinstance(current, keras.Variable):
            _keras_compat.set_learning_rate_variable(
                optimizer, _ScaledRate(current, optimizer, ramp)
            )
        else:
            _keras_compat.set_learning_rate_variable(
                optimizer, _ScaledSchedule(current, ramp)
            )
        if (
            self.momentum_correction
            and isinstance(optimizer, keras.optimizers.SGD)
            and isinstance(optimizer.momentum, float)
            and optimizer.momentum
        ):
            installed["momentum"] = optimizer.momentum
            optimizer.momentum = _CorrectedMomentum(optimizer.momentum, optimizer, ramp)

        def original_config(_optimizer=optimizer, _installed=installed):
            # Saves made during fit describe the optimizer as it was built.
            # Only SGD with momentum_correction has its momentum replaced;
            # other optimizers (Adam, RMSprop, ...) may have no momentum.
            corrected = _installed["momentum"] is not None
            scaled_rate = _keras_compat.learning_rate_variable(_optimizer)
            scaled_momentum = _optimizer.momentum if corrected else None
            _keras_compat.set_learning_rate_variable(_optimizer, _installed["rate"])
            if corrected:
                _optimizer.momentum = _installed["momentum"]
            try:
                return type(_optimizer).get_config(_optimizer)
            finally:
                _keras_compat.set_learning_rate_variable(_optimizer, scaled_rate)
                if corrected:
                    _optimizer.momentum = scaled_momentum

        optimizer.get_config = original_config
        installed["ramp"] = ramp
        self._installed = installed
        self.factor = factor
        self.final_multiplier = ramp.final
        self.warmup_total_steps = steps
        # A train function traced before (an earlier fit) holds the old rate.
        _fit_session.invalidate_train_function(model)
        if self.verbose and worker_info(strategy).is_chief:
            print(
                f"LearningRateScaler: {replicas} replica(s), "
                f"factor {factor:g}, rule {self.rule!r}: learning rate x"
                f"{ramp.final:g}"
                + (f" after a {steps}-step linear warmup" if steps else "")
                + "."
            )

    def _uninstall_stale(self, optimizer) -> None:
        """Removes a scaling left by a fit that ended with an exception."""
        rate = _keras_compat.learning_rate_variable(optimizer)
        if isinstance(rate, _ScaledRate):
            _keras_compat.set_learning_rate_variable(optimizer, rate.variable)
        elif isinstance(rate, _ScaledSchedule):
            _keras_compat.set_learning_rate_variable(optimizer, rate.schedule)
        if isinstance(getattr(optimizer, "momentum", None), _CorrectedMomentum):
            optimizer.momentum = optimizer.momentum.momentum
        optimizer.__dict__.pop("get_config", None)

    def _uninstall(self) -> None:
        if self._installed is None:
            return
        self._uninstall_stale(self._installed["optimizer"])
        self._installed = None
        # The next fit traces again, with or without a scaler.
        _fit_session.invalidate_train_function(self.model)

    # -- state for BackupAndRestore ------------------------------------------

    def get_state(self) -> dict:
        """The scaling in effect (saved by `BackupAndRestore`).

        The warmup's position needs no state: it is read from the
        optimizer's step counter, which the backup restores.
        """
        return {"factor": self.factor, "warmup_steps": self.warmup_total_steps}

    def set_state(self, state: dict) -> None:
        """Warns when the resumed run scales differently from the backed-up one."""
        saved = state.get("factor")
        if saved is None or self.factor is None:
            return
        if not math.isclose(float(saved), self.factor, rel_tol=1e-9):
            warnings.warn(
                "LearningRateScaler: the backed-up run scaled the learning "
                f"rate by {float(saved):g}, this run by {self.factor:g} (the "
                "number of replicas or the global batch changed). Training "
                "continues with the new factor; to continue with the old "
                f"one, pass base_batch_size so that the factor is {float(saved):g}.",
                stacklevel=2,
            )

    def current_learning_rate(self) -> float:
        """The learning rate in effect now (scaled), as a float."""
        optimizer = _innermost(self.model.optimizer)
        return float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def on_train_begin(self, logs=None):
        if self._installed is None:
            # A CallbackList built without params: install now, retrace.
            self._install(self.params or {})
            self.model.make_train_function(force=True)

    def on_train_batch_end(self, batch, logs=None):
        if self.verbose and logs is not None:
            logs["learning_rate"] = self.current_learning_rate()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = self.current_learning_rate()

    def on_train_end(self, logs=None):
        self._uninstall()
