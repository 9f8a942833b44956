"""Collectives and rank logic (`keras_dist._collectives`), checked directly."""

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist import _collectives


def run_on_replicas(make_gradient):
    """Runs `agree_on_finite` on 4 replicas; returns each replica's output."""
    strategy = keras_dist.resolve_strategy("mirrored")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            rid = tf.cast(context.replica_id_in_sync_group, tf.float32)
            (out,) = _collectives.agree_on_finite(
                optimizer, [make_gradient(rid)], context
            )
            return out

        return strategy.run(replica_fn)

    return [v.numpy() for v in strategy.experimental_local_results(step())]


def test_replicas_agree_when_one_has_non_finite_gradients():
    # Only replica 2 overflows; every replica must skip the step.
    outputs = run_on_replicas(
        lambda rid: tf.where(tf.equal(rid, 2.0), np.inf, 1.0) * tf.ones([3])
    )
    assert [bool(np.all(np.isfinite(o))) for o in outputs] == [False] * 4


def test_finite_gradients_are_left_alone():
    for value in run_on_replicas(lambda rid: tf.ones([3]) * 2.0):
        np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])


def test_plain_optimizers_are_untouched():
    g = [tf.constant([np.inf])]
    assert _collectives.agree_on_finite(keras.optimizers.SGD(), g, None) is g


def test_broadcast_from_chief_counts_each_worker_once():
    # One worker with 4 replicas: the value comes back as it went in (each
    # worker's first replica contributes, not every replica).
    broadcast = _collectives.broadcast_from_chief(keras_dist.resolve_strategy("mirrored"))
    np.testing.assert_array_equal(broadcast(np.array([1.5, -2.0], "float32")), [1.5, -2.0])
    np.testing.assert_array_equal(broadcast(np.array([3.0, 0.0], "float32")), [3.0, 0.0])


def test_agreements_on_one_worker_are_the_values_themselves():
    strategy = keras_dist.resolve_strategy("mirrored")
    assert _collectives.agree_sum(strategy, [3, 0, 7]) == [3, 0, 7]
    assert _collectives.agree_any(strategy, [True, False]) == [True, False]
    assert not _collectives.is_multi_worker(strategy)
