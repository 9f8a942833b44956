"""Layers on replicas: two-pass BatchNorm moments over the global batch,
replica-invariant dropout on Philox, attention projections, layer cloning
and traversal.
"""

from __future__ import annotations

import contextlib
import math
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.random import seed_generator as keras_random


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
    uniform = _replica_rows(_noise_shape(x, noise_shape), x.dtype, seed, context)
    kept = x * tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype)
    return tf.where(uniform >= rate, kept, tf.zeros((), x.dtype))


def _noise_shape(x, noise_shape) -> list:
    """This replica's rows, then the noise shape's other axes."""
    shape = tf.shape(x)
    return [shape[0]] + [
        shape[i] if noise_shape is None or noise_shape[i] is None else noise_shape[i]
        for i in range(1, x.shape.rank)
    ]


_ROWS = threading.local()  # per replica thread (MirroredStrategy traces one each)


@contextlib.contextmanager
def rows_start_at(start):
    """While open, this replica's rows start at global row `start` (an int64
    tensor) for the draws of Dropout and the noise layers: a batch split
    unevenly (5 rows: 3 and 2) does not start at replica id x rows."""
    previous = getattr(_ROWS, "start", None)
    _ROWS.start = start
    try:
        yield
    finally:
        _ROWS.start = previous


def _replica_rows(noise, dtype, seed, context, normal=False):
    """This replica's rows of the stateless uniform (or standard normal)
    draw one device makes for the global batch with `seed`: Philox makes
    block k of any draw directly, so the draw starts at this replica's first
    element (see `replica_invariant_dropout`)."""
    seed = keras_tf_random._cast_seed(seed)
    rows = tf.cast(noise[0], tf.int64)
    inner = tf.reduce_prod(tf.cast(tf.stack(noise[1:]), tf.int64)) if len(noise) > 1 else (
        tf.constant(1, tf.int64))
    first_row = getattr(_ROWS, "start", None)
    if first_row is None:  # an even split
        first_row = tf.cast(context.replica_id_in_sync_group, tf.int64) * rows
    start = first_row * inner
    per_block = 2 if dtype.size > 4 else 4  # Philox: 4 x 32 bits per counter step
    block, lane = start // per_block, start % per_block
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    counter = tf.bitcast(tf.bitcast(counter, tf.int64) + tf.stack(
        [block, tf.constant(0, tf.int64)]), tf.uint64)
    draw = tf.raw_ops.StatelessRandomNormalV2 if normal else tf.raw_ops.StatelessRandomUniformV2
    values = draw(
        shape=tf.reshape(rows * inner + lane, [1]), key=key, counter=counter,
        alg=tf.raw_ops.StatelessRandomGetAlg(), dtype=dtype,
    )[lane:]
    return tf.reshape(values, tf.stack([tf.cast(n, tf.int32) for n in noise]))


NOISE_LAYERS = (keras.layers.GaussianNoise, keras.layers.GaussianDropout,
                keras.layers.AlphaDropout)


def replica_invariant_noise(layer) -> None:
    """`GaussianNoise`, `GaussianDropout`, `AlphaDropout`: each of N replicas
    draws its rows of the noise one device draws for the global batch (as
    `replica_invariant_dropout`; Keras' own draw gives every replica the
    first rows' noise). The arithmetic is Keras' (and
    `tf.random.stateless_normal`'s: `noise * stddev + mean`)."""
    if getattr(layer, "_kd_invariant_dropout", False):
        return
    keras_call = layer.call

    def call(inputs, training=False):
        context = tf.distribute.get_replica_context()
        rate = getattr(layer, "rate", getattr(layer, "stddev", 0))
        if not training or not rate > 0 or context is None or (
                context.num_replicas_in_sync < 2):
            return keras_call(inputs, training=training)
        x = tf.convert_to_tensor(inputs)
        dtype = tf.as_dtype(layer.compute_dtype)
        seed = keras_random.draw_seed(layer.seed_generator)
        if isinstance(layer, keras.layers.AlphaDropout):
            noise_shape = layer.noise_shape
            if noise_shape is not None and noise_shape[0] is not None:
                return keras_call(inputs, training=training)  # one mask for every row
            uniform = _replica_rows(_noise_shape(x, noise_shape),
                                   tf.as_dtype(keras.config.floatx()), seed, context)
            kept = tf.cast(uniform >= layer.rate, x.dtype)
            alpha = 1.6732632423543772848170429916717
            scale = 1.0507009873554804934193349852946
            alpha_p = -alpha * scale
            a = ((1 - layer.rate) * (1 + layer.rate * alpha_p**2)) ** -0.5
            b = -a * alpha_p * layer.rate
            return a * (x * kept + alpha_p * (1 - kept)) + b
        noise = _replica_rows(_noise_shape(x, None), dtype, seed, context, normal=True)
        if isinstance(layer, keras.layers.GaussianNoise):
            return x + (noise * tf.cast(layer.stddev, dtype) + tf.cast(0.0, dtype))
        stddev = math.sqrt(layer.rate / (1.0 - layer.rate))
        return x * (noise * tf.cast(stddev, dtype) + tf.cast(1.0, dtype))

    layer.call = call
    layer._kd_invariant_dropout = True


def _broadcast_shape(inputs, axes):
    """The shape that broadcasts per-channel statistics against `inputs`."""
    rank = inputs.shape.rank
    shape = tf.unstack(tf.shape(inputs))
    return [1 if i in axes else shape[i] for i in range(rank)]


def attention_projections(layer) -> dict:
    """A MultiHeadAttention layer's query/key/value/output EinsumDense layers."""
    names = {"query": "_query_dense", "key": "_key_dense",
             "value": "_value_dense", "output": "_output_dense"}
    return {k: getattr(layer, v, None) for k, v in names.items()}


def iter_sublayers(model):
    """Every layer nested in `model`, at any depth."""
    return model._flatten_layers(include_self=False, recursive=True)


INTERNALS = {
    "keras.Model (compiled)": ("_flatten_layers",),
    "keras.layers.MultiHeadAttention (built)": (
        "_key_dense",
        "_output_dense",
        "_query_dense",
        "_value_dense",
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
    # replica_invariant_noise repeats these layers' arithmetic.
    "keras.src.layers.regularization.alpha_dropout.AlphaDropout (source)": (
        "1.6732632423543772848170429916717",
        "1.0507009873554804934193349852946",
        "ops.random.uniform(noise_shape, seed=self.seed_generator)",
    ),
    "keras.src.layers.regularization.gaussian_dropout.GaussianDropout (source)": (
        "math.sqrt(self.rate / (1.0 - self.rate))",
        "mean=1.0",
    ),
    "keras.src.layers.regularization.gaussian_noise.GaussianNoise (source)": (
        "inputs + backend.random.normal(",
        "mean=0.0",
    ),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
