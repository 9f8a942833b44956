"""Scenario 2: DistributedModel with steps_per_execution=8 vs Keras' working setting (1).

On several replicas keras_dist makes `steps_per_execution > 1` train
correctly; plain Keras users run `steps_per_execution=1` there. A small MLP
(64-64-64-10, global batch 64) on 2 logical-CPU replicas, where per-step
overhead dominates: plain `keras.Model` (spe 1) under the strategy's scope,
`DistributedModel` with spe 1 and with spe 8, interleaved epochs.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from benchmarks import _common  # noqa: E402


def run(args) -> dict:
    import keras_dist

    keras_dist.simulate_replicas(2)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy()
    steps = 16 if args.quick else args.steps
    batch = 64
    x, y = _common.digits(steps * batch)
    with strategy.scope():
        plain = _common.compile_model(_common.build_model("mlp", width=64))
    ours_1 = _common.compile_model(
        keras_dist.distribute(_common.build_model("mlp", width=64), strategy))
    ours_8 = _common.compile_model(
        keras_dist.distribute(_common.build_model("mlp", width=64), strategy),
        steps_per_execution=8)

    times = _common.interleave(
        {name: _common.epoch_timer(model, x, y, batch, steps)
         for name, model in (("plain", plain), ("ours_1", ours_1), ("ours_8", ours_8))},
        _common.repeats(args, 15),
    )
    rows = [
        _common.row("keras.Model, steps_per_execution=1", times["plain"], 1e3),
        _common.row("DistributedModel, steps_per_execution=1", times["ours_1"], 1e3),
        _common.row("DistributedModel, steps_per_execution=8", times["ours_8"], 1e3),
    ]
    return {
        "id": 2, "name": "steps_per_execution",
        "title": "steps_per_execution=8 (DistributedModel) vs 1 (plain Keras), 2 replicas",
        "setup": (
            f"MirroredStrategy over 2 logical CPUs; {_common.MODEL_SIZES['mlp'].format(width=64)}"
            f" on digits, Adam, global batch {batch}, {steps} steps per timed epoch."
        ),
        "unit": "ms/step", "rows": rows,
        "ratios": [{"name": "speedup, DistributedModel spe 8 over keras.Model spe 1",
                    "value": _common.paired_ratio(times["plain"], times["ours_8"])},
                   {"name": "speedup, DistributedModel spe 8 over spe 1",
                    "value": _common.paired_ratio(times["ours_1"], times["ours_8"])},
                   {"name": "steps/s DistributedModel spe 1 / keras.Model spe 1",
                    "value": _common.paired_ratio(times["plain"], times["ours_1"])}],
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=96)
    _common.main(run, __doc__, p)
