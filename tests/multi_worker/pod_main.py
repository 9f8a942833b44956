"""The training script of one pod in tests/multi_worker/test_kubernetes_pods.py.

Usage: pod_main.py OUT_DIR. Unseeded; writes OUT_DIR/rank<R>.npz (initial
weights, final weights, every logged number per epoch) and OUT_DIR/rank<R>.json (its
TF_CONFIG and strategy).
"""

import json
import os
import sys

import keras_dist

import keras  # noqa: E402
import numpy as np  # noqa: E402

out_dir = sys.argv[1]
x = np.linspace(-1, 1, 64 * 4, dtype="float32").reshape(64, 4)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
model = keras_dist.distribute(keras.Sequential([
    keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]))
model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
initial = model.get_weights()
history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                    validation_split=0.25)
rank = keras_dist.worker_info().rank
np.savez(os.path.join(out_dir, f"rank{rank}.npz"),
         **{f"history/{k}": v for k, v in history.history.items()},
         **{f"initial{i}": w for i, w in enumerate(initial)},
         **{f"final{i}": w for i, w in enumerate(model.get_weights())})
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"TF_CONFIG": json.loads(os.environ["TF_CONFIG"]),
               "strategy": keras_dist.describe(model.distribute_strategy)}, f)
