"""Scenario 5: step-time overhead of PerReplicaMetrics against the same fit without it.

Two identical `DistributedModel`s (MLP on the bundled handwritten digits, 2 simulated
replicas of MirroredStrategy on the CPU) train side by side in one process,
interleaved A B A B ..., one with `PerReplicaMetrics` at its default logging
frequency (once per epoch) and one without. Each timed run is one epoch of
`--steps` steps after a warm-up epoch (tracing excluded). Reports the median
seconds per step of each and their ratio.

Usage: python -m benchmarks.per_replica_overhead [--steps 100] [--repeats 15]
       [--replicas 2] [--width 256] [--batch 128]
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras_dist  # noqa: E402
from benchmarks import _common  # noqa: E402


def run(args) -> dict:
    keras_dist.simulate_replicas(args.replicas)
    if args.quick:
        args.steps = 10

    import keras
    import numpy as np

    from keras_dist.callbacks import PerReplicaMetrics

    digits = _common.load_digits()
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

    times = _common.interleave(
        {name: _common.epoch_timer(model, x, y, args.batch, args.steps, shuffle=False,
                                   callbacks=callbacks)
         for name, (model, callbacks) in variants.items()},
                               _common.repeats(args, 15))
    rows = [_common.row(name, values, 1e3) for name, values in times.items()]
    return {
        "id": 5, "name": "per_replica_overhead",
        "title": "PerReplicaMetrics: step-time overhead",
        "setup": (
            f"{type(strategy).__name__} over {strategy.num_replicas_in_sync} logical-CPU "
            f"replicas; MLP 64-{args.width}-{args.width}-10 on digits, Adam, global batch "
            f"{args.batch}, {args.steps} steps per epoch; two identical models in one "
            "process, one with the callback at its default update_freq=\"epoch\""
            + (", gradient_norm=True" if args.gradient_norm else "")
            + "; interleaved epochs after a warm-up epoch."
        ),
        "unit": "ms/step", "rows": rows,
        "ratios": [{"name": "step time with / without PerReplicaMetrics",
                    "value": _common.paired_ratio(times["with PerReplicaMetrics"],
                                                  times["without PerReplicaMetrics"]),
                    "goal": "< 1.03"}],
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--gradient-norm", action="store_true")
    _common.main(run, __doc__, p)
