"""
Title: Global batch and learning-rate scaling with a gradual warmup
Description: Trains with a global batch N times the one the learning rate
was tuned for (N replicas, same per-replica batch) and scales the rate with
`LearningRateScaler` (linear rule, warmup over the first epochs), printing
the rate each epoch.

Run: `python examples/lr_scaling.py` (add `--smoke` for a short run).
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

if not tf.config.list_physical_devices("GPU") and not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(4)

import keras  # noqa: E402
from _digits import load  # noqa: E402

from keras_dist.callbacks import LearningRateScaler  # noqa: E402

BASE_BATCH = 16      # the batch the rate below was tuned for, on one device
BASE_RATE = 0.02


def main(smoke: bool) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=False)
    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))

    model = keras_dist.distribute(keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]), strategy=strategy)
    model.compile(keras.optimizers.SGD(BASE_RATE, momentum=0.9),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])

    # Same per-replica batch as the one-device recipe: the global batch, and
    # so the rate, grow with the replica count.
    global_batch = BASE_BATCH * strategy.num_replicas_in_sync
    epochs, warmup = (3, 2) if smoke else (15, 2)
    # keras_dist: the rate grows step by step from BASE_RATE to
    # BASE_RATE x global_batch / BASE_BATCH over `warmup` epochs.
    scaler = LearningRateScaler("linear", base_batch_size=BASE_BATCH, warmup_epochs=warmup)
    history = model.fit(x_train, y_train, batch_size=global_batch, epochs=epochs,
                        callbacks=[scaler], verbose=0)
    for epoch, (rate, loss) in enumerate(zip(history.history["learning_rate"],
                                             history.history["loss"]), 1):
        print(f"epoch {epoch}: learning rate {rate:.4f}  loss {loss:.4f}")
    print(f"global batch {global_batch}, target rate "
          f"{BASE_RATE * global_batch / BASE_BATCH:.4f}")
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=global_batch, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(parser.parse_args().smoke)
