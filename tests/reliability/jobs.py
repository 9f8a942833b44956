"""Small launched jobs that hang, stall or train, for the liveness tests.

Usage: jobs.py KIND OUT_DIR
- prejoin: worker 1 is stuck before it creates its strategy, on the first
  run only (OUT_DIR/ran-once<rank> marks it); later runs train.
- stall: worker 1 sleeps in a callback after 20 steps (a deadlock in user
  code after joining); the other waits for it in BackupAndRestore's
  end-of-step agreement (timed backups: one collective per step).
- listen: once its cluster formed, each worker writes OUT_DIR/listen<rank>.json
  (its port, the network interfaces it sees) and waits for OUT_DIR/go.
- train: trains many short epochs; each worker writes OUT_DIR/pid<rank> once
  its cluster formed (for a test to stop one).
- abandoned: once its cluster formed, worker 0 waits in a keras_dist
  agreement (a collective outside any step) that worker 1 never joins:
  worker 1 is SIGKILLed after 2 s. Worker 0 prints whether its collective
  failed because the launcher aborted it, and exits 3.
"""

import json
import os
import sys
import time

import keras_dist

kind, out_dir = sys.argv[1], sys.argv[2]
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
marker = os.path.join(out_dir, f"ran-once{rank}")
first_run = not os.path.exists(marker)
open(marker, "w").close()
if kind == "prejoin" and rank == 1 and first_run:
    time.sleep(3600)

import keras  # noqa: E402
import numpy as np  # noqa: E402

strategy = keras_dist.resolve_strategy("auto")
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if kind == "listen":
    import socket

    port = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][rank].split(":")[1]
    with open(os.path.join(out_dir, f"listen{rank}.json"), "w") as f:
        json.dump({"port": int(port),
                   "interfaces": [name for _, name in socket.if_nameindex()]}, f)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out_dir, "go")) and time.monotonic() < deadline:
        time.sleep(0.2)
    sys.exit(0)
if kind == "abandoned":
    import signal

    from keras_dist import _collectives

    if rank == 1:
        time.sleep(2)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _collectives.agree_any(strategy, [False])
    except Exception as error:  # noqa: BLE001 (what it says is the outcome)
        print(f"collective failed, aborted by the launcher: "
              f"{'aborted by the launcher' in str(error)}", flush=True)
        sys.exit(3)
    sys.exit(0)
inputs = keras.Input((8,))
model = keras_dist.distribute(keras.Model(inputs, keras.layers.Dense(1)(inputs)), strategy)
model.compile("sgd", "mse")
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")


class Stall(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if kind == "stall" and rank == 1 and batch == 20:
            time.sleep(3600)


epochs = 200 if kind == "train" else 1
callbacks = [Stall()]
if kind == "stall":
    callbacks.append(keras_dist.callbacks.BackupAndRestore(
        os.path.join(out_dir, "backup"), save_every_seconds=3600))
model.fit(x, x[:, :1], batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
print("trained", flush=True)
