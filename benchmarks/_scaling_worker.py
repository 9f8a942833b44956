"""One worker of scenario 3 (run alone, or by `keras-dist launch`).

Sizes TensorFlow's thread pools to this worker's share of the cores before
TensorFlow starts (with `--pin`, also binds the process to one core), trains
a warm-up epoch, then `--epochs` timed epochs of `--steps` global batches,
and (chief only) prints one `RESULT {json}` line.
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
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch", type=int, default=256, help="global batch")
parser.add_argument("--model", choices=["mlp", "cnn"], default="cnn")
parser.add_argument("--intra-op-threads", type=int, required=True)
parser.add_argument("--inter-op-threads", type=int, default=2)
parser.add_argument("--pin", action="store_true",
                    help="run on one core: the worker's rank modulo the core count")
args = parser.parse_args()

if args.pin:
    rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})

import tensorflow as tf  # noqa: E402

# Before any op: each worker gets its share of the cores.
tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)

import keras_dist  # noqa: E402
from benchmarks import _common  # noqa: E402

strategy = keras_dist.resolve_strategy("auto")
from keras_dist.strategy import worker_info  # noqa: E402

info = worker_info(strategy)
x, y = _common.digits(args.steps * args.batch)
model = _common.compile_model(keras_dist.distribute(_common.build_model(args.model), strategy))
model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # warm-up: tracing
rates = []
for _ in range(args.epochs):
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    rates.append(args.steps * args.batch / (time.perf_counter() - start))
if info.is_chief:
    print("RESULT " + json.dumps({
        "workers": info.num_workers, "replicas": strategy.num_replicas_in_sync,
        "strategy": type(strategy).__name__, "samples_per_second": rates,
        "loss": history.history["loss"][-1],
    }), flush=True)
