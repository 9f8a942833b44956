"""Many fits in one process over Python-fed and array inputs, garbage
collection forced between them (tests/multi_worker/test_stress_jobs.py).

Usage: stress_main.py FITS LIMIT_SECONDS
Alone: a MirroredStrategy over 2 logical CPUs; under `keras-dist launch`:
MultiWorkerMirroredStrategy. Each fit that runs past LIMIT_SECONDS dumps
every thread's stack and exits 3 (a hang fails the test, never stalls it).
Prints `THREADS <python threads> <os threads>` after every fit from the
second round of inputs on, then one fit's progress (verbose=2) and `DONE`.
"""

import faulthandler
import gc
import os
import sys
import threading

import keras_dist

if not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

fits, limit = int(sys.argv[1]), float(sys.argv[2])
x = np.linspace(-1.0, 1.0, 64 * 4, dtype="float32").reshape(64, 4)
y = x.sum(axis=1, keepdims=True)


def forever():
    """An endless generator: its prefetch thread is busy when the fit ends."""
    while True:
        for i in range(0, 64, 16):
            yield x[i:i + 16], y[i:i + 16]


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]


def from_generator():
    return tf.data.Dataset.from_generator(
        forever,
        output_signature=(
            tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 1), tf.float32)
        ),
    )


INPUTS = [
    ("generator", lambda: dict(x=forever(), steps_per_epoch=4)),
    ("py_dataset", lambda: dict(x=Batches())),
    ("from_generator", lambda: dict(x=from_generator(), steps_per_epoch=4)),
    ("arrays", lambda: dict(x=x, y=y, batch_size=16)),
]

model = keras_dist.distribute(
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)])
)
model.compile("sgd", "mse")


def threads() -> str:
    return f"THREADS {threading.active_count()} {len(os.listdir('/proc/self/task'))}"


for i in range(fits):
    name, make = INPUTS[i % len(INPUTS)]
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        model.fit(**make(), epochs=2, verbose=0)
    finally:
        faulthandler.cancel_dump_traceback_later()
    gc.collect()
    if i >= len(INPUTS):
        print(threads(), flush=True)
    print(f"fit {i} {name} ok", flush=True)
# Keras' progress output (ProgbarLogger, verbose=2), as one process prints it.
model.fit(x, y, batch_size=16, epochs=2, verbose=2)
print("DONE", flush=True)
