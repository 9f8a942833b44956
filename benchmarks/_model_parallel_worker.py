"""One variant of scenario 6 in its own process (a DTensor mesh needs a fresh one).

`--variant mirrored`: `DistributedModel` on MirroredStrategy over 4 logical
CPUs; `fsdp=4`: `FullySharded()` over a `batch=4` mesh; otherwise a DTensor
mesh such as `batch=4`, `batch=2,model=2` or `model=4` through
`keras_dist.dtensor.shard`. Prints `RESULT {json}`: ms per
step of each timed epoch and the bytes each device holds (live variables).
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
times = []
if args.variant == "mirrored":
    model = keras_dist.distribute(model)
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # warm-up: tracing
    for _ in range(args.epochs):
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
        times.append((time.perf_counter() - start) / args.steps * 1e3)
    held = sum(v.value.values[0].numpy().nbytes for v in model.weights)
    memory = {"variables": held, "replicated_variables": held}
else:
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
    sharded.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # warm-up: tracing
    for _ in range(args.epochs):
        start = time.perf_counter()
        sharded.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
        times.append((time.perf_counter() - start) / args.steps * 1e3)
    memory = sharded.bytes_per_device()
print("RESULT " + json.dumps({"ms_per_step": times, **{f"bytes_{k}": v
                                                        for k, v in memory.items()},
                              "params": int(sum(np.prod(w.shape) for w in model.weights))}),
      flush=True)
