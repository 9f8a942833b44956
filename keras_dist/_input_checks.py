"""Checks of in-memory input and fit arguments, made before any work starts.

Keras checks most of this inside its array adapter; keras_dist turns arrays
into its own seeded dataset first (see `_data.array_dataset`), so it checks
the same things itself, and a few more that would otherwise fail only after
TensorFlow started working (out-of-range class labels, a negative
`validation_split`, a fractional `epochs`).
"""

from __future__ import annotations

import numbers

import keras
import numpy as np
import tensorflow as tf


def check_trains_here(method: str) -> None:
    """Refuses training on a job's evaluator task, before any work.

    Managed services (Vertex AI, SageMaker, Kubeflow's TFJob) run the same
    script on every task of `TF_CONFIG`; the evaluator is outside the
    training cluster, and a fit there would train a model of its own, in
    silence, beside the job.
    """
    from keras_dist import _cluster

    cluster = _cluster.parse_tf_config()
    if cluster is None or cluster.task_type != "evaluator":
        return
    raise RuntimeError(
        f"{method}(): this process is the job's evaluator task (TF_CONFIG "
        f"task {{'type': 'evaluator', 'index': {cluster.task_index}}}), which "
        f"trains nothing: the chief and the {cluster.num_workers - 1} other "
        "worker(s) train. Received: a training call on the evaluator. Branch "
        "on keras_dist.worker_info().task_type == 'evaluator' and evaluate "
        "there instead: load what the chief saves (ModelCheckpoint or "
        "model.save() on storage both see) and call evaluate() (see "
        "docs/launch.md, 'Managed jobs')."
    )


def _is_array(value) -> bool:
    return isinstance(value, (np.ndarray, tf.Tensor))


def _arrays(name: str, value) -> list[tuple[str, object]]:
    """(label, array) for each array leaf of `value`, labelled for messages."""
    if value is None:
        return []
    if _is_array(value):
        return [(name, value)]
    if isinstance(value, dict):
        leaves = []
        for key in sorted(value, key=str):
            leaves += _arrays(f"{name}[{key!r}]", value[key])
        return leaves
    if isinstance(value, (list, tuple)):
        leaves = []
        for i, item in enumerate(value):
            leaves += _arrays(f"{name}[{i}]", item)
        return leaves
    return []


def check_arrays(x, y=None, sample_weight=None, prefix: str = "") -> None:
    """Same number of samples everywhere, at least one, numeric dtypes.

    Raises:
        ValueError: naming each argument with its number of samples (or the
            offending dtype) and the fix.
    """
    leaves = (
        _arrays(prefix + "x", x)
        + _arrays(prefix + "y", y)
        + _arrays(prefix + "sample_weight", sample_weight)
    )
    if not leaves:
        return
    sizes = {}
    for label, array in leaves:
        shape = array.shape
        if len(shape) == 0:
            raise ValueError(
                f"Invalid value for argument `{label}`: a scalar has no "
                f"samples. Received: {label} with shape (). Pass an array "
                "whose first dimension indexes the samples."
            )
        sizes[label] = None if shape[0] is None else int(shape[0])
        _check_dtype(label, array)
    known = {size for size in sizes.values() if size is not None}
    if len(known) > 1:
        listed = ", ".join(f"{label}: {size}" for label, size in sizes.items())
        raise ValueError(
            "Data cardinality is ambiguous: every array must hold the same "
            f"number of samples (first dimension). Received: {listed}. Pass "
            "arrays of equal length (one row per sample in each)."
        )
    if known == {0}:
        listed = ", ".join(f"{label}: {size}" for label, size in sizes.items())
        raise ValueError(
            "Invalid input: the arrays hold no samples. Received: "
            f"{listed}. Pass at least one sample."
        )


def check_no_missing_inputs(multi_worker: bool, x, prefix: str = "") -> None:
    """`None` for an optional input is refused under multi-worker training.

    TensorFlow's multi-worker input pipeline reads every element's shape
    (`NoneTensorSpec` has none) and fails inside the first step; on one
    process (one device or `MirroredStrategy`) such inputs train.
    """
    if not multi_worker or not isinstance(x, (dict, list, tuple)):
        return
    leaves = x.items() if isinstance(x, dict) else enumerate(x)
    missing = [key for key, value in leaves if value is None]
    if missing:
        raise ValueError(
            f"Invalid value for argument `{prefix}x`: `None` for an optional "
            "input is not supported under multi-worker training (TensorFlow's "
            "multi-worker input pipeline needs a shape for every input). "
            f"Received: None for {', '.join(repr(k) for k in missing)}. Pass an "
            "array for every input (e.g. zeros with a mask input of your "
            "own), or train that model on one worker."
        )


def check_inputs(model, x, y=None, sample_weight=None, prefix: str = "") -> None:
    """`check_arrays`, then `check_class_labels` of `y` for `model`."""
    check_arrays(x, y, sample_weight, prefix)
    check_class_labels(model, y, prefix + "y")


def _check_dtype(label: str, array) -> None:
    # As Keras: NumPy arrays of strings or objects are refused; a tf.Tensor
    # of strings is fine (a model may start with a text layer).
    if isinstance(array, tf.Tensor) or array.dtype.kind in "biufc":
        return
    raise ValueError(
        f"Invalid dtype for argument `{label}`: NumPy arrays must hold "
        f"numbers. Received: {label} of dtype {array.dtype}. Convert strings "
        "to numbers first (e.g. `keras.layers.StringLookup`), or pass text "
        "as a `tf.constant` to a model that starts with a text layer."
    )


def check_fit_arguments(epochs, initial_epoch, validation_split) -> None:
    for name, value in (("epochs", epochs), ("initial_epoch", initial_epoch)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(
                f"Invalid type for argument `{name}`. Expected a non-negative "
                f"integer. Received: {name}={value!r} of type "
                f"{type(value).__name__}."
            )
        if value < 0:
            raise ValueError(
                f"Invalid value for argument `{name}`. Expected a non-negative "
                f"integer. Received: {name}={value}."
            )
    if (
        not isinstance(validation_split, numbers.Real)
        or isinstance(validation_split, bool)
        or not 0.0 <= validation_split < 1.0
    ):
        raise ValueError(
            "Invalid value for argument `validation_split`. Expected a "
            "fraction of the samples in [0, 1). Received: "
            f"validation_split={validation_split!r}. Pass e.g. 0.2 to "
            "validate on the last 20% of the samples, or 0 for none."
        )


# -- class labels ---------------------------------------------------------------

_SPARSE_NAMES = ("sparse_categorical_crossentropy",)


def _sparse_loss(loss):
    """(is sparse categorical crossentropy, ignore_class) for a compiled loss."""
    if isinstance(loss, str):
        return loss in _SPARSE_NAMES, None
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return True, getattr(loss, "ignore_class", None)
    if loss is keras.losses.sparse_categorical_crossentropy:
        return True, None
    return False, None


def _class_labels(model) -> tuple[int, int | None] | None:
    """(number of classes, ignore_class) when `model` is compiled with a sparse
    categorical crossentropy on one output whose class count is known."""
    if getattr(model, "loss", None) is None:
        return None
    sparse, ignore_class = _sparse_loss(model.loss)
    if not sparse:
        return None
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    classes = outputs[0].shape[-1]
    return None if classes is None else (int(classes), ignore_class)


def _label_message(argument: str, classes: int) -> str:
    return (
        f"Invalid value in argument `{argument}`: the loss "
        "sparse_categorical_crossentropy takes class indices in "
        f"[0, {classes}) for this model's {classes} outputs. "
    )


_LABEL_FIX = (
    "Map the labels to 0..classes-1, or give the last layer as many units as "
    "there are classes."
)


def label_range_check(model):
    """A `data -> data` function for the step, or None: the batch's integer
    class labels must lie in [0, classes) (`check_class_labels`'s rule, for
    input that cannot be scanned up front: `tf.data`, generators,
    `PyDataset`). A bad batch stops the step before its update, with the fix
    (TensorFlow's own error names no argument; on a GPU the loss is NaN)."""
    found = _class_labels(model)
    if found is None:
        return None
    classes, ignore_class = found

    def checked(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not isinstance(y, tf.Tensor) or not y.dtype.is_integer:
            return data
        labels = y if ignore_class is None else tf.boolean_mask(
            y, tf.not_equal(y, tf.cast(ignore_class, y.dtype))
        )
        message = _label_message("y", classes) + "Received: a batch with a label outside it. " + _LABEL_FIX
        checks = [
            tf.debugging.assert_non_negative(labels, message=message),
            tf.debugging.assert_less(labels, tf.cast(classes, labels.dtype), message=message),
        ]
        with tf.control_dependencies(checks):
            y = tf.identity(y)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)

    return checked


def check_class_labels(model, y, argument: str = "y") -> None:
    """Integer labels of a sparse categorical loss lie in [0, classes).

    Checked for a single-output model whose class count is known; TensorFlow
    would otherwise fail inside the first step on CPUs, and give NaN losses
    silently on GPUs.
    """
    if not _is_array(y):
        return
    found = _class_labels(model)
    if found is None:
        return
    classes, ignore_class = found
    labels = np.asarray(y)
    if labels.dtype.kind not in "iu" or labels.size == 0:
        return
    if ignore_class is not None:
        labels = labels[labels != ignore_class]
        if labels.size == 0:
            return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise ValueError(
            _label_message(argument, classes)
            + f"Received: a label {bad} (labels range from {low} to {high}). "
            + _LABEL_FIX
        )
