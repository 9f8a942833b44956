"""
Title: A custom training loop with strategy.run and strategy.reduce
Description: Trains a DistributedModel's variables with a hand-written loop
(`strategy.run` per step, `strategy.reduce` for the loss) on the handwritten
digits shipped in examples/data, then checks it against `DistributedModel.fit`: same weights.

Run: `python examples/custom_training_loop.py` (add `--smoke` for 1 epoch).
On a CPU it simulates 2 replicas; with 2+ GPUs it uses them.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

if not tf.config.list_physical_devices("GPU"):
    keras_dist.simulate_replicas(2)  # before TensorFlow starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _digits import load_digits  # noqa: E402 (examples/data, no download)

GLOBAL_BATCH = 64


def build(strategy) -> keras_dist.DistributedModel:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(128, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-4))(inputs)
    outputs = keras.layers.Dense(10)(h)
    # keras_dist: variables are created on the strategy, no scope needed.
    return keras_dist.DistributedModel(inputs, outputs, strategy=strategy)


def main(smoke: bool) -> dict:
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]
    epochs = 1 if smoke else 5

    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))
    model = build(strategy)
    with strategy.scope():  # the optimizer's variables live on the strategy too
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    # 1437 examples in batches of 64: the last batch of 29 splits 15 / 14.
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(GLOBAL_BATCH)
    distributed = strategy.experimental_distribute_dataset(dataset)

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            # keras_dist: this replica's share of the global mean loss, exact
            # for the uneven last batch, plus the L2 term once in total.
            loss = keras_dist.average_loss(loss_fn(y, logits), model=model)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # summed
        return loss

    @tf.function
    def train_step(batch):
        per_replica = strategy.run(step, args=batch)
        return strategy.reduce("SUM", per_replica, axis=None)  # the global mean

    for epoch in range(epochs):
        losses = [float(train_step(batch)) for batch in distributed]
        print(f"epoch {epoch + 1}: first-batch loss {losses[0]:.4f}, "
              f"mean loss {np.mean(losses):.4f}")

    # The same training through fit, from the same initial weights and order.
    reference = build(strategy)
    reference.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=epochs,
                  shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max())
                     for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"max weight difference, loop vs fit: {difference:.2e}")

    logits = model.predict(x_test, batch_size=GLOBAL_BATCH, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    print(f"test accuracy {accuracy:.4f}")
    return {"difference": difference, "accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="one epoch")
    main(parser.parse_args().smoke)
