"""
Title: Mixed precision on several replicas
Description: Trains a small CNN on the bundled handwritten digits with the
`mixed_bfloat16` policy on CPUs and TPUs, or `mixed_float16` (with dynamic
loss scaling) on GPUs: float32 variables, 16-bit computation, and
keras_dist keeping every replica's loss-scale decision in agreement.

Run: `python examples/mixed_precision.py` (add `--smoke` for 2 epochs).
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

GPU = bool(tf.config.list_physical_devices("GPU"))
if not GPU and not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
from _digits import load  # noqa: E402


def main(smoke: bool) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=True)
    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))

    # float16 needs loss scaling (Keras wraps the optimizer in a
    # LossScaleOptimizer when compiling); bfloat16 has float32's range.
    policy = "mixed_float16" if GPU else "mixed_bfloat16"
    keras.config.set_dtype_policy(policy)
    net = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        # The last layer in float32: a softmax in 16 bits loses precision.
        keras.layers.Dense(10, activation="softmax", dtype="float32"),
    ])
    keras.config.set_dtype_policy("float32")
    # keras_dist: the copy keeps each layer's dtype policy.
    model = keras_dist.distribute(net, strategy=strategy)
    # keras_dist: with mixed_float16, a step whose gradients overflow on any
    # replica is skipped on all of them (plain Keras decides per replica).
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    print(f"policy {policy}: variables {model.trainable_weights[0].dtype}, "
          f"computation {net.layers[0].compute_dtype}, optimizer "
          f"{type(model.optimizer).__name__}")
    history = model.fit(x_train, y_train, per_replica_batch_size=32,
                        epochs=2 if smoke else 10, verbose=0 if smoke else 2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"first loss {history.history['loss'][0]:.4f}  "
          f"last loss {history.history['loss'][-1]:.4f}")
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs")
    main(parser.parse_args().smoke)
