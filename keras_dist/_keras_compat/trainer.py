"""Keras' TensorFlow trainer: the symbolic build without a reduce (fix 1), and
accessors for keras_dist's step code (`_steps.py`).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.models.functional import Functional  # noqa: F401 (re-exported)
from keras.src.models.model import functional_init_arguments  # noqa: F401 (re-exported)
from keras.src.trainers.data_adapters import array_data_adapter as keras_array_adapter
from keras.src.trainers.data_adapters import (
    tf_dataset_adapter as keras_tf_dataset_adapter,
)

from keras_dist._keras_compat.distribute import first_replica_batch


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


def loss_tracker(model) -> keras.metrics.Mean:
    """The `Mean` behind a compiled model's `loss` log."""
    return model._loss_tracker


def logits_of(y_pred) -> tuple[list, list]:
    """(logits, forms) of a model's outputs in the graph that made them.

    Keras' crossentropies on the TensorFlow backend compute from the logits
    a prediction came from: `_keras_logits` (set by Keras' softmax and
    sigmoid activations), else the input of a Softmax/Sigmoid op. The form
    of each flat output: "keras", "Softmax", "Sigmoid" or None (no logits;
    the prediction itself is returned in their place).
    """
    logits, forms = [], []
    for output in tf.nest.flatten(y_pred):
        op = getattr(output, "op", None)
        if hasattr(output, "_keras_logits"):
            forms.append("keras")
            logits.append(output._keras_logits)
        elif op is not None and op.type in ("Softmax", "Sigmoid") and len(op.inputs) == 1:
            forms.append(op.type)
            logits.append(op.inputs[0])
        else:
            forms.append(None)
            logits.append(output)  # a placeholder: never read
    return logits, forms


def with_logits(y_pred, logits, forms):
    """The gathered predictions as Keras' losses find them in its own step."""
    outputs = []
    for output, logit, form in zip(tf.nest.flatten(y_pred), logits, forms, strict=True):
        if form == "keras":
            output = tf.identity(output)
            output._keras_logits = logit
        elif form == "Softmax":
            output = tf.nn.softmax(logit)
        elif form == "Sigmoid":
            output = tf.sigmoid(logit)
        outputs.append(output)
    return tf.nest.pack_sequence_as(y_pred, outputs)


INTERNALS = {
    "keras.Model (compiled)": (
        "_autoconvert_optionals",
        "_call_has_training_arg",
        "_compute_loss",
        "_distribute_strategy",
        "_loss_tracker",
        "_symbolic_build",
    ),
    "keras.src.backend.tensorflow.trainer": ("concat",),
    "keras.src.backend.tensorflow.trainer.TFEpochIterator (source)": (
        "_distributed_dataset",
    ),
    "keras.src.losses.loss": ("unscale_loss_for_distribution",),
    # logits_of / with_logits: the attribute Keras' crossentropies read.
    "keras.src.backend.tensorflow.nn._get_logits (source)": ("_keras_logits",),
    "keras.src.activations.activations.softmax (source)": ("_keras_logits",),
    "keras.src.models.functional": ("Functional",),
    # DistributedModel.__init__ does inject_functional_model_class's rewrite
    # on the user's classes only (see _make_functional).
    "keras.src.models.model": ("functional_init_arguments", "inject_functional_model_class"),
    "tensorflow.python.distribute.values.PerReplicaSpec (source)": ("_value_specs",),
    "keras.src.trainers.data_adapters.array_data_adapter": ("ArrayDataAdapter",),
    "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter (source)": (
        "_inputs",
    ),
    "keras.src.trainers.data_adapters.tf_dataset_adapter": ("TFDatasetAdapter",),
    "keras.src.trainers.data_adapters.tf_dataset_adapter.TFDatasetAdapter (source)": (
        "_dataset",
    ),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
