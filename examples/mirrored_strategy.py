"""
Title: Synchronous data parallelism on one machine with MirroredStrategy
Description: Trains a small CNN on the bundled handwritten digits on every
device of one machine (2 simulated CPU replicas here, all GPUs elsewhere),
with synchronized BatchNormalization, then saves it and reloads it on a
different strategy.

Run: `python examples/mirrored_strategy.py` (add `--smoke` for 2 epochs).
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

# keras_dist: on a CPU, split it into 2 logical devices before TensorFlow
# starts; MirroredStrategy then runs 2 real replicas with real all-reduces.
if not tf.config.list_physical_devices("GPU"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
from _digits import load  # noqa: E402


def main(smoke: bool) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=True)

    # keras_dist: ask for MirroredStrategy by name (or pass your own
    # tf.distribute.MirroredStrategy(devices=...)).
    strategy = keras_dist.resolve_strategy("mirrored")
    print(keras_dist.describe(strategy))

    # keras_dist: a Sequential-style model distributed in one call; every
    # variable is created under the strategy's scope for you.
    model = keras_dist.distribute(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        # keras_dist: BatchNormalization statistics are synchronized across
        # replicas (global-batch moments), unlike plain Keras.
        keras.layers.BatchNormalization(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]), strategy=strategy)
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])

    # keras_dist: give the batch per replica; the global batch is 32 x replicas.
    history = model.fit(x_train, y_train, per_replica_batch_size=32,
                        epochs=2 if smoke else 10, verbose=0 if smoke else 2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"first loss {history.history['loss'][0]:.4f}  "
          f"last loss {history.history['loss'][-1]:.4f}")
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")

    # keras_dist: a saved DistributedModel loads on any strategy (here the
    # default one-device strategy) and gives the same results.
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "digits.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        _, again = restored.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"reloaded test accuracy {again:.4f}")
    return {"accuracy": accuracy, "reloaded": again}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs")
    main(parser.parse_args().smoke)
