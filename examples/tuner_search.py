"""
Title: Distributed hyperparameter search with keras-tuner
Description: Searches the width, dropout and learning rate of a digits
classifier with `keras_dist.tuner.RandomSearch`: every trial trains on the
strategy keras_dist picks, and `keras-dist tune` shares the trials among
several tuner workers through keras-tuner's own gRPC oracle.

Run:
- one process (trials one after another, each on 2 simulated replicas):
  `python examples/tuner_search.py`
- a chief and 2 tuner workers, trials in parallel:
  `keras-dist tune --num-workers 2 examples/tuner_search.py`
- each trial on a 2-worker MultiWorkerMirroredStrategy cluster:
  `keras-dist tune --num-workers 2 --workers-per-trial 2 examples/tuner_search.py`
Add `--smoke` for a 2-trial, 1-epoch search. The results go to
`--directory` (default `tuner_search/`); rerun with `--resume` to continue an
interrupted search instead of starting over.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_dist  # noqa: E402

# keras_dist: on a machine without GPUs, a process searching on its own
# splits its CPU into 2 logical devices, so each trial trains on 2 replicas.
# Processes started by `keras-dist tune` (KERASTUNER_TUNER_ID is set) keep
# one device each: they share the machine's cores already.
import tensorflow as tf  # noqa: E402

if (
    not tf.config.list_physical_devices("GPU")
    and "KERASTUNER_TUNER_ID" not in os.environ
    and not os.environ.get("TF_CONFIG")
):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _digits import load_digits  # noqa: E402 (examples/data, no download)

from keras_dist.callbacks import LearningRateScaler  # noqa: E402
from keras_dist.tuner import RandomSearch  # noqa: E402


def build_model(hp):
    # A plain Keras model: keras_dist.tuner converts it to a DistributedModel
    # on the trial's strategy.
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(hp.Choice("units", [32, 64, 128]), activation="relu"),
        keras.layers.Dropout(hp.Float("dropout", 0.0, 0.4, step=0.2)),
        keras.layers.Dense(10),
    ])
    model.compile(
        keras.optimizers.Adam(hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description="Distributed digits search.")
    parser.add_argument("--smoke", action="store_true", help="2 trials, 1 epoch")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--directory", default="tuner_search")
    parser.add_argument("--resume", action="store_true",
                        help="continue the search in --directory")
    args = parser.parse_args()
    trials, epochs = (2, 1) if args.smoke else (args.trials, args.epochs)

    # 1797 8x8 digit images, shipped in examples/data; a fixed split.
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]

    # keras_dist: the tuner takes keras-tuner's arguments, plus `strategy`
    # ("auto": MirroredStrategy here, MultiWorkerMirroredStrategy in a trial
    # group, the default strategy in a one-device tuner worker).
    tuner = RandomSearch(
        build_model,
        objective="val_accuracy",
        max_trials=trials,
        max_retries_per_trial=1,  # a trial whose worker dies runs again
        seed=0,
        directory=args.directory,
        project_name="digits",
        overwrite=not args.resume,
    )
    # keras_dist: on the chief, `search` serves the oracle and returns when
    # the last trial is done; on tuner workers it runs trials. The
    # LearningRateScaler is copied into every trial and scales each trial's
    # rate with its replica count.
    tuner.search(
        x_train, y_train,
        epochs=epochs,
        batch_size=64,
        validation_split=0.2,
        callbacks=[LearningRateScaler("linear", warmup_epochs=1)],
        verbose=0,
    )

    # keras_dist: only the process that holds the whole search (the chief,
    # or a process searching on its own) reports the result.
    if not keras_dist.tuner.is_chief():
        return
    trials_done = [t for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    best_hp = tuner.get_best_hyperparameters(1)[0]
    best = tuner.get_best_models(1)[0]
    _, accuracy = best.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"{len(trials_done)} trials completed")
    print(f"best hyperparameters: {best_hp.values}")
    print(f"best model: test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
