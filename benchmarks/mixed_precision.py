"""Scenario 8: mixed_bfloat16 vs float32, step time and final loss.

The same `DistributedModel` (CNN on digits, 2 logical-CPU replicas) built
under each dtype policy, trained side by side for the same epochs,
interleaved. CPUs gain little or lose from bfloat16 (no bfloat16 matrix
units on most); the figure that matters is on a GPU or TPU (see
benchmarks/README.md).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from benchmarks import _common  # noqa: E402


def run(args) -> dict:
    import keras_dist

    keras_dist.simulate_replicas(2)
    import keras
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    steps = 5 if args.quick else args.steps
    batch = 128
    x, y = _common.digits(steps * batch)
    models = {}
    for policy in ("float32", "mixed_bfloat16"):
        keras.config.set_dtype_policy(policy)
        models[policy] = _common.compile_model(keras_dist.distribute(
            _common.build_model("cnn", dtype=None if policy == "float32" else policy)))
    keras.config.set_dtype_policy("float32")
    losses = {policy: [] for policy in models}

    def epoch(policy):
        def measure():
            seconds = _common.timed(lambda: losses[policy].append(models[policy].fit(
                x, y, batch_size=batch, epochs=1, verbose=0).history["loss"][-1]))
            return seconds / steps
        return measure

    times = _common.interleave({p: epoch(p) for p in models}, _common.repeats(args, 15))
    rows = [_common.row(p, times[p], 1e3, final_loss=losses[p][-1]) for p in models]
    strategy = models["float32"].distribute_strategy
    return {
        "id": 8, "name": "mixed_precision",
        "title": "mixed_bfloat16 vs float32",
        "setup": (
            f"{type(strategy).__name__} over {strategy.num_replicas_in_sync} "
            f"{'GPU' if gpus else 'logical CPU'} replicas; {_common.MODEL_SIZES['cnn']} on "
            f"digits, Adam, global batch {batch}, {steps} steps per epoch, "
            f"{len(losses['float32'])} epochs each, interleaved (final loss after the last)."
        ),
        "unit": "ms/step", "rows": rows,
        "ratios": [{"name": "speedup, mixed_bfloat16 over float32",
                    "value": _common.paired_ratio(times["float32"], times["mixed_bfloat16"])}],
        "notes": "On a CPU without bfloat16 matrix units the cast overhead can make "
                 "mixed precision slower; run it on a GPU for the figure that matters.",
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=40)
    _common.main(run, __doc__, p)
