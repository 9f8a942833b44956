"""Step-time overhead of PerReplicaMetrics against the same fit without it.

Two identical `DistributedModel`s (MLP on scikit-learn's digits, 2 simulated
replicas of MirroredStrategy on the CPU) train side by side in one process,
interleaved A B A B ..., one with `PerReplicaMetrics` at its default logging
frequency (once per epoch) and one without. Each timed run is one epoch of
`--steps` steps after a warm-up epoch (tracing excluded). Reports the median
seconds per step of each and their ratio.

Usage: python benchmarks/per_replica_overhead.py [--steps 60] [--repeats 7]
       [--replicas 2] [--width 256] [--batch 128]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_dist  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--gradient-norm", action="store_true")
    return parser.parse_args()


def main():
    args = parse_args()
    keras_dist.simulate_replicas(args.replicas)

    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    from keras_dist.callbacks import PerReplicaMetrics

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    # Enough rows for one epoch of `steps` global batches.
    reps = -(-args.steps * args.batch // len(x))
    x, y = np.concatenate([x] * reps), np.concatenate([y] * reps)
    x, y = x[: args.steps * args.batch], y[: args.steps * args.batch]

    def build():
        keras.utils.set_random_seed(0)
        model = keras_dist.distribute(
            keras.Sequential([
                keras.Input((64,)),
                keras.layers.Dense(args.width, activation="relu"),
                keras.layers.Dense(args.width, activation="relu"),
                keras.layers.Dense(10),
            ])
        )
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    monitor = PerReplicaMetrics(gradient_norm=args.gradient_norm)
    variants = {
        "without PerReplicaMetrics": (build(), []),
        "with PerReplicaMetrics": (build(), [monitor]),
    }
    strategy = next(iter(variants.values()))[0].distribute_strategy

    def run(model, callbacks):
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=callbacks)
        return (time.perf_counter() - start) / args.steps

    for model, callbacks in variants.values():  # warm-up: tracing
        run(model, callbacks)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (model, callbacks) in variants.items():
            times[name].append(run(model, callbacks))

    base = statistics.median(times["without PerReplicaMetrics"])
    print(
        f"# PerReplicaMetrics overhead: {strategy.num_replicas_in_sync} replicas "
        f"({type(strategy).__name__}), MLP 64-{args.width}-{args.width}-10, "
        f"Adam, global batch {args.batch}, {args.steps} steps per epoch, "
        f"median of {args.repeats} interleaved epochs"
        + (", gradient_norm=True" if args.gradient_norm else "")
    )
    print("| variant | ms per step (median) | spread (min-max) | ratio |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"| {name} | {median * 1e3:.2f} | {min(values) * 1e3:.2f}-"
            f"{max(values) * 1e3:.2f} | {median / base:.3f} |"
        )


if __name__ == "__main__":
    main()
