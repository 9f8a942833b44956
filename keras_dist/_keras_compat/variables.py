"""Moving an existing model onto a strategy, in place: variable storage,
optimizers' strategy and per-variable keys, registered names.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def _storage(variable):
    """The `tf.Variable` behind a Keras variable (None while deferred)."""
    return getattr(variable, "_value", None)


def on_strategy(variable, strategy: tf.distribute.Strategy) -> bool:
    """Whether a Keras variable's storage was created under `strategy`."""
    value = _storage(variable)
    if value is None:
        return True  # created on first use, under whatever scope is open then
    return getattr(value, "_distribute_strategy", None) is strategy


def host_counter() -> tf.Variable:
    """An int64 variable on this process's CPU, outside any strategy.

    Made under a strategy's scope too (the class itself, not `tf.Variable`,
    whose creator scopes would make it a mirrored variable): a `tf.data`
    function reads it on the host that runs the input pipeline.
    """
    with tf.init_scope(), tf.device("/cpu:0"):
        return resource_variable_ops.ResourceVariable(
            0, dtype=tf.int64, trainable=False, name="keras_dist_pass"
        )


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


INTERNALS = {
    "keras.optimizers.Optimizer (built)": (
        "_distribution_strategy",
        "_trainable_variables",
        "_trainable_variables_indices",
        "_var_key",
    ),
    "keras.src.optimizers.base_optimizer.BaseOptimizer (source)": (
        "_exclude_from_weight_decay",
        "_exclude_from_weight_decay_cache",
    ),
    "keras.Variable": ("_initialize", "_value"),
    "tensorflow.python.ops.resource_variable_ops": ("ResourceVariable",),
    "keras.src.saving.object_registration": ("GLOBAL_CUSTOM_NAMES",),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
