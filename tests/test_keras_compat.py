"""The private Keras touch points, checked directly."""

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist import _keras_compat


def test_replicas_agree_when_one_has_non_finite_gradients():
    strategy = keras_dist.resolve_strategy("mirrored")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            rid = tf.cast(context.replica_id_in_sync_group, tf.float32)
            # Only replica 2 overflows.
            g = tf.where(tf.equal(rid, 2.0), np.inf, 1.0) * tf.ones([3])
            (out,) = _keras_compat.agree_on_finite(optimizer, [g], context)
            return optimizer.check_finite([out])

        return strategy.run(replica_fn)

    verdicts = [bool(v) for v in strategy.experimental_local_results(step())]
    assert verdicts == [False, False, False, False]


def test_finite_gradients_are_left_alone():
    strategy = keras_dist.resolve_strategy("mirrored")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            g = tf.ones([3]) * 2.0
            return _keras_compat.agree_on_finite(optimizer, [g], context)[0]

        return strategy.run(replica_fn)

    for value in strategy.experimental_local_results(step()):
        np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])


def test_plain_optimizers_are_untouched():
    g = [tf.constant([np.inf])]
    assert _keras_compat.agree_on_finite(keras.optimizers.SGD(), g, None) is g
