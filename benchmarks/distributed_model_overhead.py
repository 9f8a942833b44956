"""Scenario 1: DistributedModel.fit vs keras.Model.fit under the same MirroredStrategy.

Two replicas (the CPU split into 2 logical devices), the same model built
twice with the same weights: once as a plain `keras.Model` under
`strategy.scope()` (what Keras users write), once as
`keras_dist.distribute(model, strategy)`. Interleaved epochs of `--steps`
steps after a warm-up epoch; median ms per step and the steps/s ratio.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from benchmarks import _common  # noqa: E402


def run(args) -> dict:
    import keras_dist

    keras_dist.simulate_replicas(2)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy()
    steps = 5 if args.quick else args.steps
    batch = 128
    x, y = _common.digits(steps * batch)
    rows, ratios = [], []
    for kind in ("mlp", "cnn"):
        with strategy.scope():
            plain = _common.compile_model(_common.build_model(kind))
        ours = _common.compile_model(keras_dist.distribute(_common.build_model(kind),
                                                           strategy))

        times = _common.interleave(
            {"keras.Model": _common.epoch_timer(plain, x, y, batch, steps),
             "DistributedModel": _common.epoch_timer(ours, x, y, batch, steps)},
            _common.repeats(args, 15),
        )
        rows.append(_common.row(f"{kind}: keras.Model.fit", times["keras.Model"], 1e3))
        rows.append(_common.row(f"{kind}: DistributedModel.fit", times["DistributedModel"],
                                1e3))
        ratios.append({"name": f"{kind}: steps/s DistributedModel / keras.Model",
                       "value": _common.paired_ratio(times["keras.Model"],
                                                     times["DistributedModel"]),
                       "goal": ">= 0.98"})
    return {
        "id": 1, "name": "distributed_model_overhead",
        "title": "DistributedModel.fit vs keras.Model.fit (same MirroredStrategy)",
        "setup": (
            f"MirroredStrategy over 2 logical CPUs; {_common.MODEL_SIZES['mlp'].format(width=256)}"
            f" and {_common.MODEL_SIZES['cnn']} on digits (8x8x1), Adam, global batch "
            f"{batch}, {steps} steps per timed epoch, interleaved after a warm-up "
            "epoch; ratio: median over rounds of the two models' back-to-back epochs."
        ),
        "unit": "ms/step", "rows": rows, "ratios": ratios,
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=40)
    _common.main(run, __doc__, p)
