"""keras_dist under Ray Train's `TensorflowTrainer` (tests/multi_worker/test_ray_jobs.py).

Run as `python ray_main.py HEAD_ADDRESS WORK_DIR` with a Ray cluster up at
HEAD_ADDRESS. Two runs of one training function on 2 Ray workers, one per
node: uninterrupted, then with Ray worker 1's process SIGKILLed mid-epoch on
its first attempt (Ray's FailureConfig restarts the group; keras_dist's
BackupAndRestore on the run's storage resumes it). Prints one JSON line.
"""

import json
import os
import sys

import h5py
import numpy as np
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.tensorflow import TensorflowTrainer

EPOCHS, BATCH = 3, 32


def train(config):
    import signal

    import keras
    import tensorflow as tf

    import keras_dist
    from keras_dist.callbacks import BackupAndRestore

    info = keras_dist.worker_info()
    work, kill_at = config["work"], config["kill_at"]
    attempt_marker = os.path.join(work, f"{config['name']}-started-{info.rank}")
    first_attempt = not os.path.exists(attempt_marker)
    open(attempt_marker, "a").close()

    rng = np.random.default_rng(0)  # the same data on every worker and attempt
    x = rng.random((640, 8)).astype("float32")
    y = (x @ rng.random((8, 1)) + 0.1 * rng.random((640, 1))).astype("float32")
    keras.utils.set_random_seed(1)  # the weights only: both runs start alike
    tf.random.set_seed(None)  # keras_dist draws and records the shuffle's seed
    model = keras_dist.distribute(keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.2), keras.layers.Dense(1)]))
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])

    class KillOnce(keras.callbacks.Callback):
        """SIGKILLs this Ray worker's process at global step `kill_at`."""

        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [BackupAndRestore(os.path.join(work, config["name"], "backup"), save_freq=4),
                 keras_dist.callbacks.RayReport({"loss": "loss", "validation_loss": "val_loss"})]
    if kill_at and info.rank == 1 and first_attempt:
        callbacks.append(KillOnce())
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
                        validation_split=0.25, callbacks=callbacks)
    np.savez(os.path.join(work, f"{config['name']}-rank{info.rank}.npz"), *model.get_weights())
    with open(os.path.join(work, f"{config['name']}-rank{info.rank}.json"), "w") as f:
        json.dump({"rank": info.rank, "num_workers": info.num_workers,
                   "strategy": keras_dist.describe(model.distribute_strategy),
                   "tf_config": json.loads(os.environ["TF_CONFIG"]),
                   "node": ray.get_runtime_context().get_node_id(),
                   "epochs_run": len(history.history["loss"]),
                   "last_logs": {k: v[-1] for k, v in history.history.items()},
                   "first_attempt": first_attempt}, f)


def run(name, kill_at, work):
    trainer = TensorflowTrainer(
        train, train_loop_config={"work": work, "name": name, "kill_at": kill_at},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, placement_strategy="SPREAD"),
        run_config=RunConfig(name=name, storage_path=os.path.join(work, "storage"),
                             failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(work, f"{name}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
        with np.load(os.path.join(work, f"{name}-rank{rank}.npz")) as saved:
            ranks[-1]["weights"] = [saved[f"arr_{i}"].tolist() for i in range(len(saved.files))]
    with result.checkpoint.as_directory() as directory:  # RayReport's: the final weights
        with h5py.File(os.path.join(directory, "model.weights.h5")) as f:
            files = sorted(os.listdir(directory))
            reported = [f[k][()].tolist() for k in _datasets(f) if k.startswith("layers/")]
    return {"error": repr(result.error) if result.error else None, "ranks": ranks,
            "metrics": {k: v for k, v in result.metrics.items()
                        if k in ("loss", "validation_loss", "epoch")},
            "checkpoint_files": files, "checkpoint_weights": reported}


def _datasets(group, prefix=""):
    """The paths of an HDF5 file's arrays, in file order."""
    found = []
    for name in group:
        item = group[name]
        path = f"{prefix}/{name}" if prefix else name
        found += _datasets(item, path) if hasattr(item, "keys") else [path]
    return found


if __name__ == "__main__":
    ray.init(address=sys.argv[1], log_to_driver=False)
    work = sys.argv[2]
    nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    report = {"nodes": nodes, "uninterrupted": run("uninterrupted", 0, work),
              "killed": run("killed", 21, work)}  # epoch 2, step 6 (15 steps per epoch)
    print(json.dumps(report), flush=True)
