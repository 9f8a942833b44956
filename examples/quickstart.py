"""
Title: Quickstart: a Keras model on 2 replicas with keras_dist
Description: Trains a small classifier on the handwritten digits shipped in examples/data
set with `DistributedModel` on 2 simulated replicas, then evaluates it.

Run: `python examples/quickstart.py` (add `--smoke` for a 1-epoch run), or
as a 2-worker job: `keras-dist launch --num-workers 2 examples/quickstart.py`.
On a machine with 2+ GPUs the same script uses them instead.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_dist  # noqa: E402

# keras_dist: split the CPU into 2 logical devices before TensorFlow starts,
# so this laptop trains on 2 real replicas. Skipped where GPUs exist, and
# when `keras-dist launch` runs this script as one worker of a multi-worker
# job (TF_CONFIG is set; each worker then trains on its own CPU).
import tensorflow as tf  # noqa: E402

if not tf.config.list_physical_devices("GPU") and not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _digits import load_digits  # noqa: E402 (examples/data, no download)


def main(smoke: bool) -> dict:
    # 1797 8x8 images of handwritten digits, shipped in examples/data.
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))

    # keras_dist: "auto" picks the strategy (here MirroredStrategy, 2 CPUs).
    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))

    # keras_dist: a functional DistributedModel; no strategy.scope() needed.
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    # keras_dist: BatchNormalization is synchronized across replicas.
    h = keras.layers.BatchNormalization(momentum=0.9)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        steps_per_execution=4,  # works with several replicas in keras_dist
    )
    # keras_dist: batch per replica; the global batch is 32 x replicas.
    model.fit(
        x[:split],
        y[:split],
        per_replica_batch_size=32,
        epochs=1 if smoke else 8,
        verbose=0 if smoke else 2,
    )
    loss, accuracy = model.evaluate(x[split:], y[split:], batch_size=64, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"loss": loss, "accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="one short epoch")
    main(parser.parse_args().smoke)
