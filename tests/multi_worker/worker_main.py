"""One worker of a multi-worker test job (or the single-device reference).

Usage: worker_main.py SCENARIO OUT_DIR [key=value ...]
Writes `OUT_DIR/rank{R}.npz` with what the scenario measured.
`worker_main.py cases CASES.json` runs several scenarios in one process.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

import keras_dist  # noqa: E402

strategy = keras_dist.resolve_strategy("auto")  # MWMS under TF_CONFIG

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_dist.strategy import worker_info  # noqa: E402

rank = worker_info(strategy).rank
print(keras_dist.describe(strategy), flush=True)


def data(n=72, d=6, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, d).astype("float32")
    y = (x @ rs.randn(d, 1) + 0.1 * rs.randn(n, 1)).astype("float32")
    return x, y


def build(batch_norm):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    return keras_dist.DistributedModel(inputs, outputs, strategy=strategy)


def optimizer(name):
    return keras.optimizers.SGD(0.05) if name == "sgd" else keras.optimizers.Adam(0.02)


def scenario_train(out_dir, opts):
    results = {}
    if "policy" in opts:
        keras.config.set_dtype_policy(opts["policy"])
    x, y = data()
    model = build(opts.get("bn") == "1")
    model.compile(optimizer(opts["opt"]), "mse",
                  steps_per_execution=int(opts.get("spe", 1)))
    source = opts.get("input", "numpy")
    batch = int(opts.get("batch", 16))
    callbacks = []
    if "crash_rank" in opts and rank == int(opts["crash_rank"]):
        marker = os.path.join(out_dir, "crashed")

        class Crash(keras.callbacks.Callback):
            """Dies by SIGKILL mid-epoch, once (a marker file remembers)."""

            def on_train_batch_end(self, batch_index, logs=None):
                if batch_index == 2 and not os.path.exists(marker):
                    with open(marker, "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(Crash())
    if source == "numpy":
        validation = (x, y) if opts.get("val") == "1" else None
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                            verbose=0, callbacks=callbacks,
                            validation_data=validation)
        if validation is not None:
            results["val_loss"] = np.array(history.history["val_loss"])
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        history = model.fit(ds, epochs=2, verbose=0, callbacks=callbacks)
    for i, w in enumerate(model.get_weights()):
        results[f"w{i}"] = w
    results["loss"] = np.array(history.history["loss"])
    print("fit done", flush=True)
    results["eval"] = np.array(model.evaluate(x, y, batch_size=batch, verbose=0))
    print("evaluate done", flush=True)
    results["pred"] = model.predict(x, batch_size=batch, verbose=0)
    print("predict done", flush=True)
    model.save(os.path.join(out_dir, "model.keras"))
    return results


def scenario_coverage(out_dir, opts):
    results = {}
    # Counts how often each sample is seen across all workers and replicas.
    n = int(opts.get("n", 50))
    x = np.arange(n, dtype="float32").reshape(n, 1)
    y = np.zeros((n, 1), "float32")

    class Counter(keras_dist.DistributedModel):
        """Reports, per step, how often each sample id was seen."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs["ids"] if isinstance(inputs, dict) else inputs)

        def train_step(self, data):
            inputs, _ = data
            if isinstance(inputs, dict):
                inputs = inputs["ids"]
            ids = tf.cast(tf.reshape(inputs, [-1]), tf.int32)
            # Logs are averaged over replicas: multiplied back below.
            return {"ids": tf.reduce_sum(tf.one_hot(ids, n), axis=0)}

    epochs = int(opts.get("epochs", 2))
    seen = np.zeros((epochs, n))

    class Tally(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            replicas = strategy.num_replicas_in_sync
            seen[self.epoch] += np.asarray(logs["ids"]) * replicas

    model = Counter(strategy=strategy)
    model.compile("sgd", "mse")
    # TensorFlow's global seed (earlier cases set it to 1 on both workers:
    # Keras' own order): one per worker, or none (keras_dist's shuffle).
    if opts.get("global_seed") == "per_worker":
        tf.random.set_seed(100 + rank)
    elif opts.get("global_seed") == "none":
        tf.random.set_seed(None)
    source = opts.get("input", "numpy")
    if source in ("numpy", "dict"):
        inputs = {"ids": x} if source == "dict" else x
        model.fit(inputs, y, batch_size=8, epochs=epochs, shuffle=True, verbose=0,
                  callbacks=[Tally()])
    elif source == "dataset":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=3).batch(8)
        model.fit(ds, epochs=epochs, verbose=0, callbacks=[Tally()])
    else:
        # A file-based pipeline: 4 TFRecord files, sharded by file.
        files = sorted(
            os.path.join(opts["files"], f) for f in os.listdir(opts["files"])
        )

        def parse(record):
            features = tf.io.parse_single_example(
                record, {"id": tf.io.FixedLenFeature([1], tf.float32)}
            )
            return features["id"], tf.zeros([1])

        ds = tf.data.Dataset.from_tensor_slices(files).interleave(
            tf.data.TFRecordDataset, cycle_length=1
        ).map(parse).batch(8)
        model.fit(ds, epochs=epochs, verbose=0, callbacks=[Tally()])
    results["seen"] = seen
    return results


def scenario_callbacks(out_dir, opts):
    results = {}
    # LearningRateScaler + PerReplicaMetrics; rank `slow` sleeps after each
    # step, so the chief must name it as a straggler.
    from keras_dist.callbacks import LearningRateScaler, PerReplicaMetrics

    x, y = data(n=64)
    model = build(False)
    model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
    callbacks = [
        LearningRateScaler(warmup_steps=4),
        PerReplicaMetrics(csv_path=os.path.join(out_dir, "replicas.csv"),
                          straggler_steps=4),
    ]
    if rank == int(opts.get("slow", -1)):

        class Sleep(keras.callbacks.Callback):
            def on_train_batch_end(self, batch_index, logs=None):
                time.sleep(0.15)

            def on_epoch_end(self, epoch, logs=None):
                # Its peers begin the next epoch and wait for it: its epoch
                # begins well after theirs.
                time.sleep(0.6)

        callbacks.append(Sleep())
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=callbacks)
    for key, values in history.history.items():
        results[key.replace("/", "__")] = np.array(values)
    return results


def scenario_agree(out_dir, opts):
    results = {}
    # Every worker's vote counts: worker r contributes r + 1 and 10 (r + 1).
    from keras_dist import _collectives

    results["sum"] = np.array(_collectives.agree_sum(strategy, [rank + 1, 10 * (rank + 1)]))
    return results


def scenario_lean(out_dir, opts):
    results = {}
    # What fit creates per epoch: the training input's distributed
    # iterators, and whether each checks every step for data left on the
    # other workers (partial-batch handling).
    from tensorflow.python.distribute import input_lib

    import gc
    import weakref

    from keras_dist import _keras_compat
    from keras_dist._keras_compat import iterators as compat_iterators

    created, iterators = [], []
    original_iter = input_lib.DistributedDataset.__iter__

    def counting_iter(self):
        created.append(bool(self._enable_get_next_as_optional))
        iterator = original_iter(self)
        iterators.append(weakref.ref(iterator))
        return iterator

    input_lib.DistributedDataset.__iter__ = counting_iter
    if strategy.num_replicas_in_sync > 1:
        # The job's strategy was made with the default communication (ring
        # on CPUs): the same request gets it, other options are refused.
        same = keras_dist.resolve_strategy("auto", communication="ring") is strategy
        results["same_strategy"] = np.array(same)
        try:
            keras_dist.resolve_strategy(
                "auto",
                communication=tf.distribute.experimental.CommunicationOptions(
                    bytes_per_pack=1024
                ),
            )
            results["conflict"] = np.array("")
        except ValueError as e:
            results["conflict"] = np.array(str(e))
    class RootMeanSquare(keras.metrics.Metric):
        """A user's metric: read eagerly at epoch end (Keras' own are read
        in one compiled call)."""

        def __init__(self, name="rms"):
            super().__init__(name=name)
            self.total = self.add_variable(shape=(), initializer="zeros", name="total")
            self.count = self.add_variable(shape=(), initializer="zeros", name="count")

        def update_state(self, y_true, y_pred, sample_weight=None):
            error = keras.ops.square(y_true - y_pred)
            self.total.assign_add(keras.ops.sum(error))
            self.count.assign_add(keras.ops.cast(keras.ops.size(error), "float32"))

        def result(self):
            return keras.ops.sqrt(self.total / keras.ops.maximum(self.count, 1.0))

    n = int(opts.get("n", 64))
    x, y = data(n=n)
    model = build(False)
    model.compile("adam", "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    results["checks"] = np.array(created)
    results["loss"] = np.array(history.history["loss"])
    results["mae"] = np.array(history.history["mae"])
    # Iterators over arrays are torn down on the release thread; a PyDataset
    # (Python feeds its prefetch thread) where Keras drops them.
    background = compat_iterators._RELEASE_QUEUE is not None

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[16 * i:16 * i + 16], y[16 * i:16 * i + 16]

    model.fit(Batches(), epochs=2, verbose=0)
    released = _keras_compat.wait_for_released_iterators(timeout=120)
    gc.collect()
    results["released"] = np.array(
        [background, released, all(ref() is None for ref in iterators)]
    )
    model.compile("sgd", "mse", metrics=["mae", RootMeanSquare()])
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    results["eval_mae"] = np.array(evaluated["mae"])
    results["eval_rms"] = np.array(evaluated["rms"])
    for i, w in enumerate(model.get_weights()):
        results[f"w{i}"] = w
    input_lib.DistributedDataset.__iter__ = original_iter
    return results


SCENARIOS = {"train": scenario_train, "coverage": scenario_coverage,
             "callbacks": scenario_callbacks, "agree": scenario_agree, "lean": scenario_lean}


def run_case(scenario, out_dir, opts):
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario!r}")
    os.makedirs(out_dir, exist_ok=True)
    results = SCENARIOS[scenario](out_dir, opts)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)


scenario, out_dir = sys.argv[1], sys.argv[2]
if scenario == "cases":
    # Several cases one after another in this process (OUT_DIR is a JSON
    # file: [[scenario, out_dir, "key=value", ...], ...]), as a user's
    # script runs several fits: each writes its own OUT_DIR/rank{R}.npz.
    with open(out_dir) as f:
        cases = json.load(f)
    for case in cases:
        print(f"case {case[0]} {case[1]}", flush=True)
        run_case(case[0], case[1], dict(a.split("=", 1) for a in case[2:]))
        keras.config.set_dtype_policy("float32")
else:
    run_case(scenario, out_dir, dict(a.split("=", 1) for a in sys.argv[3:]))
print("done", flush=True)
