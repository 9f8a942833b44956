"""One worker of scenarios 3 and 9: per-fit start-up and per-step throughput.

Run by `keras-dist launch` (`--framework keras_dist`), by the harness with
its own `TF_CONFIG` in the tf-keras environment (`--framework tf_keras`,
Keras 2's `MultiWorkerMirroredStrategy` job written as its docs show), or
alone (`--framework keras`: plain Keras 3 on one core with no strategy, the
ceiling's half). Sizes TensorFlow's thread pools before TensorFlow starts
(with `--pin`, also binds the process to the core of its rank), then, on
the same arrays:

1. a warm-up `fit` (tracing);
2. `--fits` short `fit` calls of `--short-steps` steps each: start-up = the
   call's wall time minus the time from its first batch's begin to its last
   batch's end (callback timestamps), i.e. everything `fit` does that is not
   a step;
3. one long `fit` of `--epochs` epochs of `--steps` steps: samples/s from the
   end of its first epoch to the end of its last batch (epoch boundaries
   included), timed by a callback.

keras_dist also counts, over the long fit, the host round trips a step
makes beyond Keras' own (one train-function call and its logs read back):
collectives keras_dist issues outside the step (agreements between the
workers), per step within the epochs and in the whole fit. With `--backup` it then trains the long
fit again with keras_dist's `BackupAndRestore` (a save per epoch, SIGTERM
handled: what a fault-tolerant job runs) and reports the same figures.

Prints one `RESULT {json}` line (every worker; the harness reads the chief's).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser()
parser.add_argument("--framework", choices=["keras_dist", "tf_keras", "keras"], required=True)
parser.add_argument("--steps", type=int, default=30, help="steps per epoch of the long fit")
parser.add_argument("--epochs", type=int, default=4, help="epochs of the long fit")
parser.add_argument("--fits", type=int, default=5, help="short fits timed for start-up")
parser.add_argument("--short-steps", type=int, default=2)
parser.add_argument("--batch", type=int, default=1024,
                    help="the batch this process trains on per step (global batch of a job)")
parser.add_argument("--intra-op-threads", type=int, default=1)
parser.add_argument("--inter-op-threads", type=int, default=2)
parser.add_argument("--pin", action="store_true")
parser.add_argument("--rank", type=int, default=None,
                    help="core to pin to when there is no TF_CONFIG (ceiling processes)")
parser.add_argument("--communication", default=None,
                    help="keras_dist only: resolve_strategy communication= (ring, nccl, auto)")
parser.add_argument("--mixed-precision", action="store_true")
parser.add_argument("--gpu", action="store_true", help="use the GPU of this process's rank")
parser.add_argument("--backup", action="store_true",
                    help="keras_dist only: the long fit again, with BackupAndRestore")
args = parser.parse_args()

task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
rank = args.rank if args.rank is not None else task.get("index", 0)
if args.pin:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
if args.gpu:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
if args.framework == "tf_keras":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
else:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)

from benchmarks import _common  # noqa: E402

if args.framework == "tf_keras":
    import tf_keras as keras
else:
    import keras

    if args.framework == "keras_dist":
        import keras_dist


def build(strategy):
    """The scenario's CNN, built and compiled as the framework's docs show."""
    layers = keras.layers
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")

    def make():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(), layers.Flatten(),
            layers.Dense(128, activation="relu"), layers.Dense(10, dtype="float32"),
        ])
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    if args.framework == "keras_dist":
        return keras_dist.distribute(make(), strategy)
    if strategy is None:
        return make()
    with strategy.scope():
        return make()


class Clock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begins, self.ends, self.epoch_ends = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends.append(time.perf_counter())


if args.framework == "keras_dist":
    options = {} if args.communication is None else {"communication": args.communication}
    strategy = keras_dist.resolve_strategy("auto", **options)
    workers = keras_dist.worker_info(strategy).num_workers
elif args.framework == "tf_keras" and task:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
else:
    strategy, workers = None, 1

model = build(strategy)
x, y = _common.digits(args.steps * args.batch)
short = args.short_steps * args.batch
x_short, y_short = x[:short], y[:short]
model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # warm-up: tracing

startups = []
for _ in range(args.fits):
    clock = Clock()
    began = time.perf_counter()
    model.fit(x_short, y_short, batch_size=args.batch, epochs=1, verbose=0, callbacks=[clock])
    ended = time.perf_counter()
    startups.append((ended - began) - (clock.ends[-1] - clock.begins[0]))


class Agreements(keras.callbacks.Callback):
    """Counts the collectives keras_dist issues outside the step (each goes
    through `_collectives.agree_sum`) between one batch's begin and the
    next's within an epoch (what a step costs beyond Keras' own round trip:
    one train-function call, its logs read back), and in the whole fit
    (while the callback is entered as a context)."""

    def __init__(self):
        super().__init__()
        self.count, self.within, self.gaps = 0, 0, 0
        self._mark = None

    def __enter__(self):
        from keras_dist import _collectives

        self._collectives, self._agree = _collectives, _collectives.agree_sum

        def agree_sum(*a, **k):
            self.count += 1
            return self._agree(*a, **k)

        _collectives.agree_sum = agree_sum
        return self

    def __exit__(self, *exc):
        self._collectives.agree_sum = self._agree

    def on_epoch_begin(self, epoch, logs=None):
        self._mark = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._mark is not None:
            self.within += self.count - self._mark
            self.gaps += 1
        self._mark = self.count


def long_fit(callbacks=()):
    """The timed long fit: (samples/s, median step s, history, round trips)."""
    clock = Clock()
    import contextlib

    counting = [Agreements()] if args.framework == "keras_dist" else []
    with counting[0] if counting else contextlib.nullcontext():
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
                            callbacks=[clock, *counting, *callbacks])
    timed_steps = args.steps * (args.epochs - 1)
    seconds = clock.ends[-1] - clock.epoch_ends[0]
    steps = sorted(e - b for b, e in zip(clock.begins, clock.ends))
    per_step = {
        "agreements_per_step": counting[0].within / max(1, counting[0].gaps),
        "agreements_per_fit": counting[0].count,
    } if counting else {}
    return timed_steps * args.batch / seconds, steps[len(steps) // 2], history, per_step


rate, median_step, history, per_step = long_fit()
extra = dict(per_step)
if args.backup:
    import tempfile

    from keras_dist.callbacks import BackupAndRestore

    # One folder for the job's workers (their launcher's pid), deleted by
    # the callback when the fit ends.
    folder = os.path.join(tempfile.gettempdir(), f"keras_dist_bench_backup_{os.getppid()}")
    backup_rate, _, _, backup_per_step = long_fit([BackupAndRestore(folder)])
    extra["backup_samples_per_second"] = backup_rate
    extra.update({f"backup_{k}": v for k, v in backup_per_step.items()})
print("RESULT " + json.dumps({
    "framework": args.framework, "workers": workers, "rank": rank,
    "strategy": type(strategy).__name__ if strategy is not None else "none",
    "startup_s": startups, "startup_median_s": statistics.median(startups),
    "samples_per_second": rate,
    "median_step_s": median_step,
    "loss": float(history.history["loss"][-1]),
    **extra,
}), flush=True)
