"""
Title: Fault tolerance: a training run killed mid-epoch resumes exactly
Description: Trains on the bundled handwritten digits with keras_dist's
BackupAndRestore, kills the training process with SIGKILL in the middle of
an epoch, restarts it, and checks that the resumed run ends with exactly the
weights of a run that was never interrupted.

Run: `python examples/fault_tolerance.py` (add `--smoke` for 2 epochs). It
starts the training process three times: killed, resumed, uninterrupted.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def train(backup_dir: str, weights_path: str, epochs: int, kill_at_step: int | None):
    """One training process (2 replicas on a CPU); SIGKILLs itself at a step."""
    import tensorflow as tf

    import keras_dist

    if not tf.config.list_physical_devices("GPU"):
        keras_dist.simulate_replicas(2)
    import keras
    import numpy as np
    from _digits import load

    from keras_dist.callbacks import BackupAndRestore

    (x_train, y_train), _ = load(images=False)
    keras.utils.set_random_seed(0)  # the same initial weights in every process
    model = keras_dist.distribute(keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.2),  # its random state is backed up too
        keras.layers.Dense(10, activation="softmax"),
    ]))
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            print(f"starting at optimizer step {step}"
                  + (" (resumed from the backup)" if step else ""), flush=True)

        def on_epoch_end(self, epoch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            print(f"epoch {epoch + 1}/{epochs} done at optimizer step {step}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if kill_at_step is not None and step == kill_at_step:
                print(f"killed at optimizer step {step} (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    # keras_dist: a backup every 10 steps, written atomically; the resume
    # replays the data order and skips the trained batches. Its place in the
    # list does not matter: it restores before any callback's first batch.
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, shuffle=True, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=10), Report()])
    print(f"finished at optimizer step {int(model.optimizer.iterations.numpy())}")
    np.savez(weights_path, *model.get_weights())


def main(smoke: bool) -> dict:
    import numpy as np

    epochs = 2 if smoke else 6
    steps = epochs * -(-1438 // 64)
    kill_at = steps // 2 + 3  # mid-epoch, between two backups

    def run(backup_dir, weights_path, kill_at_step=None):
        command = [sys.executable, __file__, "--role", "train", "--epochs", str(epochs),
                   "--backup-dir", backup_dir, "--weights", weights_path]
        if kill_at_step is not None:
            command += ["--kill-at-step", str(kill_at_step)]
        expected = 0 if kill_at_step is None else -signal.SIGKILL
        with tempfile.TemporaryFile("w+") as errors:
            with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors,
                                  text=True) as child:
                for line in child.stdout:  # its progress, as it happens
                    if line.strip():
                        print("   " + line.rstrip(), flush=True)
            if child.returncode != expected:
                errors.seek(0)
                sys.stderr.write(errors.read())
                raise SystemExit(
                    f"the training process exited with code {child.returncode} "
                    f"(expected {expected}); its error output is above"
                )
        return child.returncode

    with tempfile.TemporaryDirectory() as work:
        backup, fresh = os.path.join(work, "backup"), os.path.join(work, "fresh")
        print("1. training, killed mid-epoch:")
        code = run(backup, os.path.join(work, "a.npz"), kill_at)
        print(f"   exit code {code} ({'SIGKILL' if code == -signal.SIGKILL else 'unexpected'})")
        print("2. the same command again: resumes from the backup")
        run(backup, os.path.join(work, "resumed.npz"))
        print("3. an uninterrupted run, for comparison")
        run(fresh, os.path.join(work, "uninterrupted.npz"))
        resumed = np.load(os.path.join(work, "resumed.npz"))
        reference = np.load(os.path.join(work, "uninterrupted.npz"))
        difference = max(float(np.abs(resumed[k] - reference[k]).max()) for k in reference)
    print(f"max weight difference, resumed vs uninterrupted: {difference:.3g}")
    return {"difference": difference}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs")
    parser.add_argument("--role", choices=["main", "train"], default="main",
                        help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--backup-dir", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "train":
        train(args.backup_dir, args.weights, args.epochs, args.kill_at_step)
    else:
        main(args.smoke)
