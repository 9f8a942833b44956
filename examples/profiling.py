"""
Title: Profiling distributed steps and watching device memory
Description: Records a TensorFlow profiler trace of a few distributed
training steps (open it in TensorBoard's Profile tab) and reports each
device's memory (GPU memory where TensorFlow has it, the host's memory and
CPU use otherwise) with keras_dist's ResourceMonitor.

Run: `python examples/profiling.py` (add `--smoke` for a short run). The
trace lands in `--log-dir` (default: a new temporary directory).
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

if not tf.config.list_physical_devices("GPU") and not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
from _digits import load  # noqa: E402

from keras_dist.callbacks import ResourceMonitor  # noqa: E402


class ProfileSteps(keras.callbacks.Callback):
    """Traces batches `first`..`last` (0-based, in the first epoch) with TF's profiler.

    Skip the first batches: they include tracing and compilation.
    """

    def __init__(self, log_dir: str, first: int = 3, last: int = 6):
        super().__init__()
        self.log_dir, self.first, self.last = log_dir, first, last
        self._active = False

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.first and not self._active:
            tf.profiler.experimental.start(self.log_dir)
            self._active = True

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.last and self._active:
            tf.profiler.experimental.stop()
            self._active = False

    def on_train_end(self, logs=None):
        if self._active:  # fewer batches than `last`
            tf.profiler.experimental.stop()
            self._active = False


def main(smoke: bool, log_dir: str) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=True)
    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))
    model = keras_dist.distribute(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]), strategy=strategy)
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    # keras_dist: ResourceMonitor puts memory and CPU/GPU use in the logs
    # (here also printed every 10 batches and at each epoch's end).
    monitor = ResourceMonitor(update_freq=10, verbose=1)
    history = model.fit(x_train, y_train, per_replica_batch_size=32,
                        epochs=1 if smoke else 3, verbose=0,
                        callbacks=[ProfileSteps(log_dir), monitor])
    traces = [os.path.join(root, name) for root, _, names in os.walk(log_dir)
              for name in names if name.endswith(".xplane.pb")]
    print(f"profiler trace: {len(traces)} file(s) under {log_dir} "
          f"({sum(os.path.getsize(t) for t in traces):,} bytes); view with "
          f"`tensorboard --logdir {log_dir}` (Profile tab, needs tensorboard-plugin-profile)")
    print("host peak memory {:.0f} MB".format(history.history["memory/host_peak_rss_mb"][-1]))
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"traces": traces, "accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="one epoch")
    parser.add_argument("--log-dir", default=None, help="where the trace goes")
    args = parser.parse_args()
    main(args.smoke, args.log_dir or tempfile.mkdtemp(prefix="profile-"))
