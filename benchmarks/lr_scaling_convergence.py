"""Does a 4x global batch with LearningRateScaler converge like batch 1x?

Trains the same MLP on the bundled handwritten digits (1,437 train / 360 test
images, a fixed split) for the same number of epochs three ways:

1. one device, global batch `--batch`, SGD with momentum at `--lr`;
2. 4 replicas (MirroredStrategy over simulated CPU devices), global batch
   4 x `--batch`, the same optimizer, learning rate left alone;
3. as 2, with `LearningRateScaler("linear", warmup_epochs=...)`: the rate
   ramps from `--lr` to 4 x `--lr` over the warmup.

The 4x runs take a quarter of the steps; the question is whether scaling the
rate recovers the accuracy the unscaled run loses. Several seeds; prints a
Markdown table of test accuracy and loss (mean and range over seeds).

Usage: python benchmarks/lr_scaling_convergence.py [--epochs 15]
       [--batch 16] [--lr 0.02] [--warmup-epochs 2] [--seeds 3]
"""

import argparse
import os
import statistics

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_dist  # noqa: E402
from benchmarks import _common  # noqa: E402

REPLICAS = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    return parser.parse_args()


def main():
    args = parse_args()
    keras_dist.simulate_replicas(REPLICAS)

    import keras
    import numpy as np
    import tensorflow as tf

    from keras_dist.callbacks import LearningRateScaler

    digits = _common.load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]

    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    mirrored = keras_dist.resolve_strategy("mirrored")
    assert mirrored.num_replicas_in_sync == REPLICAS

    def train(strategy, batch, scaler, seed):
        keras.utils.set_random_seed(seed)
        model = keras_dist.distribute(
            keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]),
            strategy,
        )
        model.compile(
            keras.optimizers.SGD(args.lr, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        callbacks = []
        if scaler:
            callbacks.append(
                LearningRateScaler("linear", warmup_epochs=args.warmup_epochs)
            )
        history = model.fit(x_train, y_train, batch_size=batch, epochs=args.epochs,
                            verbose=0, callbacks=callbacks)
        loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
        rate = history.history.get("learning_rate", [args.lr])[-1]
        return accuracy, loss, rate

    big = REPLICAS * args.batch
    runs = {
        f"1 device, batch {args.batch}, lr {args.lr}": (one_device, args.batch, False),
        f"{REPLICAS} replicas, batch {big}, lr {args.lr} (not scaled)": (
            mirrored, big, False),
        f"{REPLICAS} replicas, batch {big}, LearningRateScaler linear, "
        f"warmup {args.warmup_epochs} epochs": (mirrored, big, True),
    }
    results = {name: [] for name in runs}
    for seed in range(args.seeds):
        for name, (strategy, batch, scaler) in runs.items():
            results[name].append(train(strategy, batch, scaler, seed))

    print(
        f"# digits, MLP 64-128-128-10, SGD momentum 0.9, {args.epochs} epochs, "
        f"test accuracy over {args.seeds} seeds (mean, min-max)"
    )
    print("| run | steps/epoch | final lr | test accuracy | test loss |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        batch = runs[name][1]
        accuracies = [v[0] for v in values]
        losses = [v[1] for v in values]
        print(
            f"| {name} | {-(-len(x_train) // batch)} | {values[0][2]:.3g} | "
            f"{statistics.mean(accuracies):.4f} ({min(accuracies):.4f}-"
            f"{max(accuracies):.4f}) | {statistics.mean(losses):.4f} |"
        )


if __name__ == "__main__":
    main()
