"""
Title: Training on a TPU with TPUStrategy (or the best strategy available)
Description: Connects to a TPU when one is reachable (a Cloud TPU VM, or
TPU_NAME set) and trains a small CNN on the bundled handwritten digits with
TPU-friendly settings (fixed batch shapes, several steps per execution);
without a TPU it says so and runs the same code on the best strategy here.

Run: `python examples/tpu_strategy.py` (add `--smoke` for 2 epochs).
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

if not tf.config.list_physical_devices("GPU") and not os.environ.get("TPU_NAME") \
        and not os.path.exists("/dev/accel0"):
    keras_dist.simulate_replicas(2)  # no accelerator: 2 CPU replicas

import keras  # noqa: E402
from _digits import load  # noqa: E402


TPU_HINTS = ("TPU_NAME", "COLAB_TPU_ADDR", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS")


def tpu_hint() -> str | None:
    """What says a TPU may be reachable: a TPU environment variable or a TPU VM's device."""
    for name in TPU_HINTS:
        if os.environ.get(name):
            return f"{name} is set"
    if os.path.exists("/dev/accel0"):
        return "a TPU VM device (/dev/accel0)"
    return None


def pick_strategy():
    hint = tpu_hint()
    if hint is None:
        # Looking for a TPU without a hint would query the cloud metadata
        # server; say why instead and use what is here.
        print("No TPU here (none of " + ", ".join(TPU_HINTS) + " is set and no "
              "/dev/accel0): running the same code on the best strategy available.")
        return keras_dist.resolve_strategy("auto")
    # keras_dist: "tpu" connects to the TPU cluster, initializes it and
    # builds a TPUStrategy; it raises a RuntimeError saying why when the TPU
    # cannot be reached.
    try:
        return keras_dist.resolve_strategy("tpu")
    except RuntimeError as error:
        print(f"A TPU was expected ({hint}) but not reached: {error}")
        print("Running the same code on the best strategy available here.")
        return keras_dist.resolve_strategy("auto")


def main(smoke: bool) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=True)
    strategy = pick_strategy()
    print(keras_dist.describe(strategy))

    global_batch = 32 * strategy.num_replicas_in_sync
    # TPUs compile one program per input shape: batches of a fixed size.
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=0).batch(global_batch, drop_remainder=True)
             .prefetch(tf.data.AUTOTUNE))

    model = keras_dist.distribute(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]), strategy=strategy)
    # Several steps per execution amortize the host-to-TPU round trip
    # (keras_dist makes this work with several replicas).
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=8)
    history = model.fit(train, epochs=2 if smoke else 10, verbose=0 if smoke else 2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=global_batch, verbose=0)
    print(f"first loss {history.history['loss'][0]:.4f}  "
          f"last loss {history.history['loss'][-1]:.4f}")
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs")
    main(parser.parse_args().smoke)
