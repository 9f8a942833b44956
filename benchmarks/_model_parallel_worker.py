"""One variant of scenario 6 in its own process (a DTensor mesh needs a fresh one).

`--variant mirrored`: `DistributedModel` on MirroredStrategy over 4 logical
CPUs; `fsdp=4`: `FullySharded()` over a `batch=4` mesh; otherwise a DTensor
mesh such as `batch=4`, `batch=2,model=2` or `model=4` through
`keras_dist.dtensor.shard`. Prints `RESULT {json}`: ms per step of each
timed epoch inside one `fit` call (Keras' loop, callbacks and per-step logs
included; the call's own start and end are timed apart, as `fit_overhead_ms`),
and for a DTensor mesh the same compiled step driven by a bare Python loop
that reads the loss once per epoch (`own_loop_ms_per_step`: what keras_dist's
own loop did before the sharded model moved to Keras' fit), the two
alternated epoch by epoch; and the bytes each device holds (live variables).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser()
parser.add_argument("--variant", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--width", type=int, default=1024)
args = parser.parse_args()

import keras_dist  # noqa: E402
import keras_dist.dtensor as kd  # noqa: E402

if args.variant == "mirrored":
    keras_dist.simulate_replicas(4)
else:
    kd.initialize(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _common  # noqa: E402

x, y = _common.digits(args.steps * args.batch)
model = _common.compile_model(_common.build_model("mlp", width=args.width))


class EpochTimes(keras.callbacks.Callback):
    """Each epoch's wall time inside a fit call, and the call's own time."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(time.perf_counter() - self._start)


def fit_epochs(trained, epochs: int) -> tuple[list[float], float]:
    """ms per step of each epoch of one fit call, and what the call took
    beyond its epochs (data adapter, callbacks, start and end), in ms."""
    timer = EpochTimes()
    start = time.perf_counter()
    trained.fit(x, y, batch_size=args.batch, epochs=epochs, verbose=0, callbacks=[timer])
    whole = time.perf_counter() - start
    return [t / args.steps * 1e3 for t in timer.epochs], (whole - sum(timer.epochs)) * 1e3


times, own_times, overheads = [], [], []
if args.variant == "mirrored":
    model = keras_dist.distribute(model)
    fit_epochs(model, 1)  # warm-up: tracing
    for _ in range(args.epochs):
        epoch_times, overhead = fit_epochs(model, 1)
        times += epoch_times
        overheads.append(overhead)
    held = sum(v.value.values[0].numpy().nbytes for v in model.weights)
    memory = {"variables": held, "replicated_variables": held}
else:
    from tensorflow.experimental import dtensor

    shape = {k: int(v) for k, v in (p.split("=") for p in args.variant.split(","))}
    fully_sharded = "fsdp" in shape
    if fully_sharded:
        shape = {"batch": shape.pop("fsdp")}
    mesh = kd.make_mesh(shape, [f"cpu:{i}" for i in range(4)])
    # Pure data parallelism on a mesh without a "model" axis: an empty map,
    # every variable replicated.
    sharded = kd.shard(model, mesh, kd.FullySharded() if fully_sharded
                       else None if "model" in shape
                       else keras.distribution.LayoutMap(mesh))
    fit_epochs(sharded, 1)  # warm-up: tracing
    # The own loop, as keras_dist's was: each batch sliced from the arrays
    # and copied onto the mesh, the compiled step fit's loop calls (the same
    # functions), no callbacks, no per-step logs, the loss read once per
    # epoch.
    step = sharded._steps().train
    b = args.batch

    def own_epoch() -> float:
        start = time.perf_counter()
        losses = [step(sharded._to_mesh(x[i * b:(i + 1) * b]),
                       sharded._to_mesh(y[i * b:(i + 1) * b]), None)[0]
                  for i in range(args.steps)]
        float(dtensor.unpack(losses[-1])[0])
        return (time.perf_counter() - start) / args.steps * 1e3

    own_epoch()  # warm-up
    for _ in range(args.epochs):
        epoch_times, overhead = fit_epochs(sharded, 1)
        times += epoch_times
        overheads.append(overhead)
        own_times.append(own_epoch())
    memory = sharded.bytes_per_device()
print("RESULT " + json.dumps({"ms_per_step": times, "own_loop_ms_per_step": own_times,
                              "fit_overhead_ms": overheads,
                              **{f"bytes_{k}": v for k, v in memory.items()},
                              "params": int(sum(np.prod(w.shape) for w in model.weights))}),
      flush=True)
