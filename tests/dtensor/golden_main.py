"""Golden runs of `keras_dist.dtensor.shard` (a subprocess: DTensor starts first).

Usage: golden_main.py MESH [OPTIMIZER ...]; MESH is model2, model4 or
batch2_model2. Prints one JSON line per optimizer: the max |weight difference| to
the same training on one device and the bytes per device.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_dist.dtensor as kd  # noqa: E402

kd.initialize(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

rs = np.random.RandomState(0)
x = rs.randn(32, 8).astype("float32")
y = (x @ rs.randn(8, 1)).astype("float32")
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.02),
}


def build(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(16, name="down"),
        keras.layers.Dense(1, name="head"),  # output dimension 1: replicated
    ], name="mlp")
    model.compile(optimizer, "mse", jit_compile=False)
    return model


MESHES = {"model2": {"model": 2}, "model4": {"model": 4},
          "batch2_model2": {"batch": 2, "model": 2}}
for shape in [MESHES[sys.argv[1]]]:
    devices = [f"cpu:{i}" for i in range(int(np.prod(list(shape.values()))))]
    mesh = kd.make_mesh(shape, devices)
    for name in sys.argv[2:] or OPTIMIZERS:
        reference = build(OPTIMIZERS[name]())
        sharded = kd.shard(
            reference, mesh, kd.LayoutMapper(mesh, min_elements=0).layout_map(reference)
        )
        reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        sharded.fit(x, y, batch_size=8, epochs=2)
        diff = max(
            float(np.abs(a - b).max())
            for a, b in zip(sharded.get_weights(), reference.get_weights())
        )
        predictions = float(np.abs(sharded.predict(x, 8) - reference.predict(x, 8, verbose=0)).max())
        print(json.dumps({"mesh": shape, "optimizer": name, "max_diff": diff,
                          "predict_diff": predictions,
                          **{f"bytes_{k}": v for k, v in sharded.bytes_per_device().items()}}),
              flush=True)
