"""`keras_dist.average_loss` in `strategy.run` loops on 4 logical CPUs."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import max_abs_diff, mlp, regression_data

import keras_dist


def four():
    return keras_dist.resolve_strategy("mirrored")


@pytest.mark.parametrize("weighted", [False, True])
def test_shares_sum_to_the_global_mean_on_an_uneven_split(weighted):
    strategy = four()
    assert strategy.num_replicas_in_sync == 4
    losses = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "float32")  # splits 2/2/2/0
    weights = np.array([1.0, 0.0, 2.0, 1.0, 1.0, 3.0], "float32")
    dataset = tf.data.Dataset.from_tensor_slices((losses, weights)).batch(6)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def shares(values, w):
        return strategy.run(
            lambda v, s: keras_dist.average_loss(v, s if weighted else None), args=(values, w))

    local = strategy.experimental_local_results(shares(*batch))
    expected = (losses * weights).sum() / weights.sum() if weighted else losses.mean()
    assert float(sum(local)) == pytest.approx(expected, rel=1e-6)
    # Each replica's share: its own sum over the global count.
    sizes = [len(v) for v in strategy.experimental_local_results(batch[0])]
    assert sizes == [2, 2, 2, 0]  # tf.distribute splits 6 over 4 so; one replica idle


def test_regularization_is_added_once_and_extra_dims_are_averaged():
    strategy = four()
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
            1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(0.5))])
    per_example = np.arange(16, dtype="float32").reshape(8, 2)  # means 0.5, 2.5, ...
    dataset = tf.data.Dataset.from_tensor_slices(per_example).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def total(values):
        shares = strategy.run(lambda v: keras_dist.average_loss(v, model=model), args=(values,))
        return strategy.reduce("SUM", shares, axis=None)

    # mean of the row means + 0.5 * (1 + 1) for the all-ones kernel.
    assert float(total(batch)) == pytest.approx(per_example.mean() + 1.0, rel=1e-6)


def test_a_loop_trains_like_one_device_on_an_uneven_last_batch():
    x, y = regression_data(n=70)  # batches of 16, the last of 6 splits 2/2/1/1
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def train(strategy):
        model = keras_dist.distribute(mlp(), strategy=strategy)
        with strategy.scope():
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            opt.build(model.trainable_variables)

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = keras_dist.average_loss(loss_fn(yb, model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def train_step(batch):
            return strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)

        for _ in range(2):
            for batch in strategy.experimental_distribute_dataset(dataset):
                train_step(batch)
        return model.get_weights()

    assert max_abs_diff(train(four()), train(keras_dist.resolve_strategy("default"))) < 1e-5


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="`per_example_loss` must have a batch dimension"):
        keras_dist.average_loss(tf.constant(1.0))
    with pytest.raises(ValueError, match=r"`sample_weight` must have shape \(batch,\)"):
        keras_dist.average_loss(tf.ones([4]), tf.ones([3]))
    with four().scope(), pytest.raises(RuntimeError, match="cross-replica context"):
        keras_dist.average_loss(tf.ones([4]))
