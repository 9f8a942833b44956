"""
Title: Multi-worker training with MultiWorkerMirroredStrategy
Description: One script, started once per worker by `keras-dist launch`
(which gives each worker its TF_CONFIG): every worker trains its share of
each global batch of the bundled handwritten digits, gradients are
all-reduced across workers, only the chief writes the model and backups.

Run: `keras-dist launch --num-workers 2 --max-restarts 1 examples/multi_worker.py`
(add `--smoke` for 2 epochs). Kill a worker mid-run (`kill -9 <pid>`): the
launcher restarts the group, which resumes from the last backup in
`./multi_worker_out` (`--out-dir`; every worker must be given the same
directory). `keras-dist launch --print-tf-config ...` shows what each worker
of a multi-host job receives; alone (no TF_CONFIG) the script trains in one
process.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_dist  # noqa: E402

# keras_dist: with TF_CONFIG set, "auto" builds MultiWorkerMirroredStrategy.
# It must exist before TensorFlow starts its runtime: resolve it first.
strategy = keras_dist.resolve_strategy("auto")

import keras  # noqa: E402
from _digits import load  # noqa: E402

from keras_dist.callbacks import BackupAndRestore  # noqa: E402


def main(epochs: int, out_dir: str, verbose: int = 2) -> dict:
    info = keras_dist.worker_info(strategy)  # chief-only printing below
    print(keras_dist.describe(strategy))
    (x_train, y_train), (x_test, y_test) = load(images=True)

    model = keras_dist.distribute(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ]), strategy=strategy)
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    # keras_dist: every worker passes the same arrays and the same global
    # batch; each keeps its own share of every batch (each sample is trained
    # exactly once per epoch across workers, with an agreed shuffle).
    # BackupAndRestore: every worker saves, only the chief's backup persists;
    # restart the job and it resumes where it stopped. The backup directory
    # must be the same on every worker (and shared storage across hosts).
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=verbose,
              callbacks=[BackupAndRestore(os.path.join(out_dir, "backup"))])
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    # keras_dist: every worker calls save (it is a collective); only the
    # chief's file is kept.
    path = os.path.join(out_dir, "digits.keras")
    model.save(path)
    if info.is_chief:
        print(f"saved {path}")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs, quiet")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out-dir", default="multi_worker_out",
                        help="backups and the saved model (the same for every "
                        "worker; default: ./multi_worker_out)")
    args = parser.parse_args()
    main(2 if args.smoke else args.epochs, args.out_dir, verbose=0 if args.smoke else 2)
