"""Small models and data shared by the in-process tests."""

import keras
import numpy as np
import tensorflow as tf

_two = {}


def two_replicas() -> tf.distribute.Strategy:
    """A user-made MirroredStrategy over 2 of the 4 logical CPUs."""
    if "s" not in _two:
        _two["s"] = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return _two["s"]


def regression_data(n=72, d=6, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, d).astype("float32")
    y = (x @ rs.randn(d, 1) + 0.1 * rs.randn(n, 1)).astype("float32")
    return x, y


def mlp(batch_norm=False, d=6, seed=1) -> keras.Model:
    """A plain Keras functional MLP with seeded initial weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((d,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model(inputs, outputs)


def optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(0.02)


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
