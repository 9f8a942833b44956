"""Golden runs of `keras_dist.dtensor.shard` (a subprocess: DTensor starts first).

Usage:
    golden_main.py steps MESH MODE[=ARG] ...  the modes below in one process
    golden_main.py golden MESH [write:DIR|read:DIR]
                                 one JSON line per (model, optimizer): the max
                                 |weight difference| to one device, bytes;
                                 the one-device references written to / read
                                 from DIR
    golden_main.py loss_matrix MESH [write:DIR|read:DIR]
                                 one JSON line per loss and metric case; the
                                 one-device runs written to / read from DIR
    golden_main.py save MESH DIR trains 1 epoch (tf.data input), saves
    golden_main.py load MESH DIR loads onto MESH, trains 1 more epoch, compares
MESH is model2, model4 or batch2_model2.
"""

import json
import os
import shutil
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_dist.dtensor as kd  # noqa: E402

# Under `keras-dist launch --num-workers 2` (multiclient): 2 logical CPUs per
# process, one mesh over the 4.
kd.initialize(2 if os.environ.get("TF_CONFIG") else 4)

import keras  # noqa: E402

import keras_dist.callbacks  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MESHES = {"model2": {"model": 2}, "model4": {"model": 4},
          "batch2_model2": {"batch": 2, "model": 2}}
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.02),
}


def data(kind, dtype="float32"):
    rs = np.random.RandomState(0)
    if kind in ("mlp", "mlp_mixed"):
        x = rs.randn(32, 8)
        return x.astype(dtype), (x @ rs.randn(8, 1)).astype(dtype)
    if kind == "transformer":
        return rs.randn(16, 5, 16).astype(dtype), rs.randn(16, 5, 1).astype(dtype)
    if kind == "conv":
        return rs.randn(32, 10, 4).astype(dtype), rs.randn(32, 3).astype(dtype)
    if kind == "einsum":
        return rs.randn(32, 6, 8).astype(dtype), rs.randn(32, 6, 1).astype(dtype)
    # Each batch of 8 holds every token id once: with a repeated id, Keras'
    # one-device Adam squares each occurrence's sparse gradient separately
    # (sum of squares, not square of the sum), which a dense gradient cannot
    # reproduce; SGD and momentum are unaffected.
    x = np.concatenate([rs.permutation(32).reshape(8, 4) for _ in range(2)])
    return x.astype("int32"), rs.randn(16, 1).astype(dtype)


def build(kind, optimizer, jit_compile=False, seeded=True):
    if seeded:
        keras.utils.set_random_seed(1)
    if kind in ("mlp", "mlp_mixed"):
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(16, name="down"),
            keras.layers.Dense(1, name="head"),  # output dimension 1: replicated
        ], name="mlp")
    elif kind == "transformer":
        inputs = keras.Input((5, 16))
        h = keras.layers.MultiHeadAttention(4, 8, name="attn")(inputs, inputs)
        h = keras.layers.LayerNormalization(name="norm")(h + inputs)
        h = keras.layers.Dense(32, activation="relu", name="fc1")(h)
        h = keras.layers.Dense(16, name="fc2")(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    elif kind == "conv":
        # A convolution (replicated: DTensor needs a replicated filter), a
        # Dense pair (sharded) and a head of 3 (replicated).
        model = keras.Sequential([
            keras.Input((10, 4)),
            keras.layers.Conv1D(16, 3, activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", name="fc1"),
            keras.layers.Dense(24, activation="relu", name="fc2"),
            keras.layers.Dense(3, name="head"),
        ], name="conv")
    elif kind == "einsum":
        inputs = keras.Input((6, 8))
        h = keras.layers.EinsumDense("abc,cd->abd", (6, 32), bias_axes="d",
                                     activation="relu", name="up")(inputs)
        h = keras.layers.EinsumDense("abc,cd->abd", (6, 16), name="down")(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    else:
        inputs = keras.Input((4,), dtype="int32")
        h = keras.layers.Embedding(32, 8, name="emb")(inputs)
        h = keras.layers.Flatten()(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    return model


def max_diff(a_weights, b_weights):
    return max(float(np.abs(a - b).max()) for a, b in zip(a_weights, b_weights))


KINDS = ("mlp", "mlp_mixed", "transformer", "embedding", "conv", "einsum")


def golden(mesh, kinds=KINDS, references=None):
    """One JSON row per (model, optimizer, dtype) on `mesh`. `references`:
    ("write", DIR) trains the one-device references and writes each one's
    weights, predictions and XLA noise floor to DIR; ("read", DIR) waits for
    them there instead of training them again (the same seeded build, data
    and training: the same computation in another process)."""
    role, directory = references or (None, None)
    for kind in kinds:
        for name in OPTIMIZERS:
            # Adam divides by sqrt(v): on a gradient entry near zero, float32
            # rounding of a different summation order moves the update by up
            # to the learning rate. float64 shows the math; float32 the noise.
            # float64 and the XLA noise floor only where float32 Adam needs them.
            needs_f64 = name == "adam" and kind == "transformer"
            for dtype in ("float32", "float64") if needs_f64 else ("float32",):
                keras.config.set_floatx(dtype)
                keras.config.set_dtype_policy(dtype)
                x, y = data(kind, dtype)
                reference = build(kind, OPTIMIZERS[name]())
                # mlp_mixed: the up bias (32 elements) stays replicated next
                # to its column-sharded kernel (256).
                mapper = kd.LayoutMapper(mesh, min_elements=64 if kind == "mlp_mixed" else 0)
                sharded = kd.shard(reference, mesh, mapper.layout_map(reference))
                row = {"model": kind, "optimizer": name, "dtype": dtype,
                       "sharded": sorted(mapper.layouts(reference))}
                path = directory and os.path.join(directory, f"{kind}-{name}-{dtype}.npz")
                if role == "read":
                    expected = read_reference(path)
                else:
                    expected = one_device(kind, name, reference, x, y,
                                          noise_floor=needs_f64 and dtype == "float32")
                    if role == "write":
                        write_reference(path, expected)
                sharded.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
                row["max_diff"] = max_diff(sharded.get_weights(), expected["weights"])
                if "noise_floor" in expected:
                    row["xla_vs_plain_one_device"] = expected["noise_floor"]
                row["predict_diff"] = float(np.abs(
                    sharded.predict(x, 8, verbose=0) - expected["predictions"]).max())
                row.update({f"bytes_{k}": v for k, v in sharded.bytes_per_device().items()})
                print(json.dumps(row), flush=True)
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")


def one_device(kind, name, reference, x, y, noise_floor=False):
    """The reference trained on one device: its weights and predictions, and
    (`noise_floor`) how far the same training compiled by XLA ends from it."""
    if noise_floor:
        other = build(kind, OPTIMIZERS[name](), jit_compile=True)
        other.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = {"weights": reference.get_weights(),
                "predictions": reference.predict(x, 8, verbose=0)}
    if noise_floor:
        expected["noise_floor"] = max_diff(other.get_weights(), expected["weights"])
    return expected


def publish(path, write):
    """`write(temporary_path)`, then renamed to `path`: readers waiting for
    `path` (`wait_for`) never see half a file."""
    temporary = path + ".tmp"
    write(temporary)
    os.replace(temporary, path)


def write_reference(path, expected):
    arrays = {f"w{i}": w for i, w in enumerate(expected["weights"])}
    arrays["predictions"] = expected["predictions"]
    if "noise_floor" in expected:
        arrays["noise_floor"] = np.array(expected["noise_floor"])

    def write(temporary):
        with open(temporary, "wb") as f:  # a file object: savez adds no suffix
            np.savez(f, **arrays)

    publish(path, write)


def wait_for(path, timeout=1500):
    """`path` once the process writing the references wrote it."""
    failed = os.path.join(os.path.dirname(path), "failed")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(failed):
            raise SystemExit(f"the process writing the references failed: {open(failed).read()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no reference at {path} after {timeout} s")
        time.sleep(0.1)
    return path


def read_reference(path, timeout=1500):
    with np.load(wait_for(path, timeout)) as saved:
        count = sum(key.startswith("w") for key in saved.files)
        expected = {"weights": [saved[f"w{i}"] for i in range(count)],
                    "predictions": saved["predictions"]}
        if "noise_floor" in saved.files:
            expected["noise_floor"] = float(saved["noise_floor"])
    return expected


def classifier():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(16, activation="relu", name="down"),
        keras.layers.Dense(4, activation="softmax", name="head"),
    ], name="clf")
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model


def classification_data():
    rs = np.random.RandomState(3)
    x = rs.randn(64, 8).astype("float32")
    return x, np.argmax(x[:, :4], axis=1).astype("int32")


def save(mesh, directory):
    x, y = classification_data()
    sharded = kd.shard(classifier(), mesh, kd.LayoutMapper(mesh, min_elements=0))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    sharded.fit(dataset, epochs=1, verbose=0)
    sharded.save(os.path.join(directory, "model.keras"))
    sharded.save_weights(os.path.join(directory, "model.weights.h5"))
    np.savez(os.path.join(directory, "after_one_epoch.npz"), *sharded.get_weights())
    open(os.path.join(directory, "saved"), "w").close()  # what `load` waits for


def load(mesh, directory):
    # Saved by another process (`save`), possibly still running.
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(directory, "saved")):
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing saved in {directory}")
        time.sleep(0.5)
    x, y = classification_data()
    reference = classifier()
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    saved = np.load(os.path.join(directory, "after_one_epoch.npz"))
    saved = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    row = {"saved_vs_one_device": max_diff(saved, reference.get_weights())}

    restored = kd.load_model(os.path.join(directory, "model.keras"), mesh,
                             kd.LayoutMapper(mesh, min_elements=0))
    row["loaded_vs_saved"] = max_diff(restored.get_weights(), saved)
    row["sharded_on_load"] = restored.bytes_per_device()
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # Adam state came too
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    row["second_epoch_vs_one_device"] = max_diff(restored.get_weights(),
                                                 reference.get_weights())

    fresh = kd.shard(classifier(), mesh, kd.LayoutMapper(mesh, min_elements=0))
    fresh.load_weights(os.path.join(directory, "model.weights.h5"))
    row["load_weights_vs_saved"] = max_diff(fresh.get_weights(), saved)

    ours = restored.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    theirs = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    row["evaluate"] = ours
    row["evaluate_keras"] = theirs
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(16, drop_remainder=True)
    row["predict_dataset_diff"] = float(np.abs(
        restored.predict(dataset, verbose=0) - reference.predict(x, verbose=0)).max())
    # 63 samples, batch 10: a last batch of 3 is padded to split over "batch".
    row["evaluate_odd"] = restored.evaluate(x[:63], y[:63], batch_size=10, verbose=0,
                                            return_dict=True)
    row["evaluate_odd_keras"] = reference.evaluate(
        x[:63], y[:63], batch_size=10, verbose=0, return_dict=True)
    row["predict_odd_diff"] = float(np.abs(
        restored.predict(x[:63], batch_size=10, verbose=0) - reference.predict(x[:63], verbose=0)).max())
    print(json.dumps(row), flush=True)


def keras_layout_map(mesh):
    """A Keras `LayoutMap` as written for `keras.distribution.ModelParallel`
    on JAX (regex keys, tuples of axes), used unchanged: the convolution's
    kernel (sharded by output channel, as in Keras' examples) is replicated
    with a warning; the rest trains as mapped."""
    import warnings

    x, y = data("conv")
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*conv/kernel"] = (None, None, "model")
    layout_map[".*conv/bias"] = ("model",)
    layout_map[".*fc1/kernel"] = (None, "model")
    layout_map[".*fc1/bias"] = ("model",)
    layout_map[".*fc2/kernel"] = ("model", None)
    reference = build("conv", OPTIMIZERS["adam"]())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = kd.shard(reference, mesh, layout_map)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    sharded.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    row = {"warnings": [str(w.message) for w in caught],
           "max_diff": max_diff(sharded.get_weights(), reference.get_weights())}
    row.update({f"bytes_{k}": v for k, v in sharded.bytes_per_device().items()})
    print(json.dumps(row), flush=True)


def callbacks(mesh, directory):
    """Keras' callbacks on a sharded model, against the same on one device:
    EarlyStopping restoring the best weights, ModelCheckpoint, and Keras'
    BackupAndRestore across a SIGKILL (one JSON line)."""
    import subprocess

    x, y = data("conv")
    x_val, y_val = x[:16] + 0.5, y[:16]
    row = {}

    def early_stopping():
        return keras.callbacks.EarlyStopping(monitor="val_loss", patience=1,
                                             restore_best_weights=True)

    # EarlyStopping on a validation loss that starts rising (a high learning
    # rate on a shifted validation set): stops and restores the best epoch.
    reference = build("conv", keras.optimizers.SGD(0.05, momentum=0.9))
    sharded = kd.shard(build("conv", keras.optimizers.SGD(0.05, momentum=0.9)), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))
    fits = {}
    for name, model in (("reference", reference), ("sharded", sharded)):
        fits[name] = model.fit(x, y, batch_size=8, epochs=30, shuffle=False, verbose=0,
                               validation_data=(x_val, y_val), callbacks=[early_stopping()])
    row["history_type"] = type(fits["sharded"]).__name__
    row["epochs"] = [len(f.history["loss"]) for f in fits.values()]
    row["history_diff"] = max(
        float(np.max(np.abs(np.array(fits["sharded"].history[k]) -
                            np.array(fits["reference"].history[k]))))
        for k in fits["reference"].history)
    row["early_stopping_diff"] = max_diff(sharded.get_weights(), reference.get_weights())

    # ModelCheckpoint: a plain .keras file per epoch, weights as trained.
    sharded = kd.shard(build("conv", OPTIMIZERS["adam"]()), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))
    path = os.path.join(directory, "epoch{epoch}.keras")
    sharded.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.ModelCheckpoint(path)])
    saved = keras.saving.load_model(path.format(epoch=2))
    row["checkpoint_files"] = sorted(os.listdir(directory))
    row["checkpoint_diff"] = max_diff(saved.get_weights(), sharded.get_weights())

    # The fit session's contract (keras_dist/_fit_session.py), kept as a
    # DistributedModel's fit keeps it: a callback's `setup_fit` sees the
    # mesh, its step wrapper runs around every step of that fit only, its
    # clean-up runs when the fit ends.
    class StepCounter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls, self.mesh, self.torn_down = 0, None, False

        def setup_fit(self, session):
            self.mesh = dict(zip(session.mesh.axis_names, session.mesh.shape))

            def wrap(step):
                def counted(data):
                    self.calls += 1
                    return step(data)
                return counted

            session.wrap_train_step(self, wrap)
            session.add_teardown(lambda: setattr(self, "torn_down", True))

    counter = StepCounter()
    sharded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[counter])
    during = counter.calls
    sharded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    row["session"] = {"mesh": counter.mesh, "calls": during, "after": counter.calls,
                      "torn_down": counter.torn_down}

    # steps_per_execution=3 and class_weight, as Keras' fit takes them.
    def classifier_of(steps_per_execution):
        model = classifier()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      "sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
        return model

    cx, cy = classification_data()
    weights = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}
    reference = classifier_of(1)
    expected = reference.fit(cx, cy, batch_size=8, epochs=2, shuffle=False, verbose=0,
                             class_weight=weights).history
    sharded = kd.shard(classifier_of(3), mesh, kd.LayoutMapper(mesh, min_elements=0))
    got = sharded.fit(cx, cy, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      class_weight=weights).history
    row["class_weight_logs_diff"] = max(
        float(np.max(np.abs(np.array(got[k]) - np.array(expected[k])))) for k in expected)
    row["class_weight_diff"] = max_diff(sharded.get_weights(), reference.get_weights())

    # keras_dist's LearningRateScaler: x2 (the "batch" axis) after a 3-step
    # linear warmup, against one device with that schedule written out.
    class Ramp(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.01 * (1.0 + keras.ops.minimum(keras.ops.cast(step, "float32") / 3.0, 1.0))

    reference = build("conv", keras.optimizers.SGD(Ramp(), momentum=0.9))
    sharded = kd.shard(build("conv", keras.optimizers.SGD(0.01, momentum=0.9)), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))
    scaler = keras_dist.callbacks.LearningRateScaler(warmup_steps=3)
    scaled = sharded.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         callbacks=[scaler]).history
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    row["scaler"] = {
        "factor": scaler.factor,
        "diff": max_diff(sharded.get_weights(), reference.get_weights()),
        "learning_rates": [float(v) for v in scaled["learning_rate"]],
        "after_fit": float(keras.ops.convert_to_numpy(sharded.optimizer.learning_rate)),
    }

    # Keras' BackupAndRestore: killed (SIGKILL) after epoch 2 of 4 in another
    # process, resumed here; equals 4 uninterrupted epochs on one device. A
    # copy of the killed run's backup is resumed onto another mesh (model=4)
    # by the model=4 process (`resume_copies`).
    backup = os.path.join(directory, "backup")
    killed = subprocess.run([sys.executable, __file__, "backup_killed", sys.argv[2], backup],
                            capture_output=True, text=True, timeout=600)
    row["killed_returncode"] = killed.returncode
    shutil.copytree(backup, backup + "_other_mesh")
    resumed = resume_from(mesh, backup)
    row["resumed_epochs"], row["resumed_diff"] = resumed["epochs"], resumed["diff"]

    # keras_dist's BackupAndRestore (a backup after every batch): killed in
    # the middle of epoch 2, resumed here and (a copy) onto model=4.
    backup = os.path.join(directory, "ours")
    killed = subprocess.run([sys.executable, __file__, "kd_backup_killed", sys.argv[2],
                             backup], capture_output=True, text=True, timeout=600)
    shutil.copytree(backup, backup + "_other_mesh")
    open(os.path.join(directory, COPIES_READY), "w").close()
    row["ours"] = resume_from(mesh, backup, ours=True)
    row["ours"]["killed_returncode"] = killed.returncode
    print(json.dumps(row), flush=True)


COPIES_READY = "copies_ready"  # `callbacks` copied both killed backups
WRITER_EXITED = "writer_exited"  # the process that runs `callbacks` ended


def resume_copies(mesh, directory, timeout=1500):
    """`callbacks`' killed backups (copies) resumed on this process's mesh,
    once that process has made them: one JSON row."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, COPIES_READY)):
        if os.path.exists(os.path.join(directory, WRITER_EXITED)):
            raise SystemExit("the callbacks process ended without copying its backups")
        if time.monotonic() > deadline:
            raise SystemExit(f"no backups to resume after {timeout} s")
        time.sleep(0.2)
    print(json.dumps({
        "other_mesh": resume_from(mesh, os.path.join(directory, "backup_other_mesh")),
        "ours_other_mesh": resume_from(mesh, os.path.join(directory, "ours_other_mesh"),
                                       ours=True),
    }), flush=True)


def backup_killed(mesh, backup, ours=False):
    """Trains with a BackupAndRestore and is SIGKILLed: Keras' after epoch 2
    of 4 (batch size 8, Adam, unshuffled); keras_dist's (`ours`, a backup
    after every batch; SGD momentum, Keras' default shuffle) in the middle
    of epoch 2, after its batch 2 of 8 (batch size 4)."""
    import signal

    from keras_dist.callbacks import BackupAndRestore

    class Kill(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1 and not ours:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_begin(self, batch, logs=None):
            if ours and self.epoch == 1 and batch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = data("conv")
    sharded = kd.shard(build("conv", OPTIMIZERS["momentum" if ours else "adam"]()), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))
    backup = BackupAndRestore(backup, save_freq=1) if ours else (
        keras.callbacks.BackupAndRestore(backup))
    if ours:
        # Keras' default shuffle=True with no TensorFlow seed: keras_dist's
        # own order, a new one each epoch, its seed drawn from NumPy's
        # generator (seeded by `build`) and kept in every backup.
        tf.random.set_seed(None)
    sharded.fit(x, y, batch_size=4 if ours else 8, epochs=4, shuffle=ours, verbose=0,
                callbacks=[backup, Kill()])


def resume_from(mesh, backup, ours=False) -> dict:
    """Resumes `backup_killed`'s backup on `mesh` with the same callback:
    the epochs trained, the optimizer's steps, the distance to 4 uninterrupted epochs
    on one device, the bytes per device."""
    from keras_dist.callbacks import BackupAndRestore

    x, y = data("conv")
    batch_size = 4 if ours else 8
    optimizer = OPTIMIZERS["momentum" if ours else "adam"]
    reference = build("conv", optimizer())
    if ours:
        # The killed run's order (shuffled, a new order each epoch, the same
        # seed drawn) on one device, uninterrupted.
        tf.random.set_seed(None)
        reference = keras_dist.distribute(reference, tf.distribute.OneDeviceStrategy("/cpu:0"))
    reference.fit(x, y, batch_size=batch_size, epochs=4, shuffle=ours, verbose=0)
    resumed = kd.shard(build("conv", optimizer()), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))
    backup = BackupAndRestore(backup, save_freq=1) if ours else (
        keras.callbacks.BackupAndRestore(backup))
    if ours:
        tf.random.set_seed(None)  # as the killed run (`build` set it)
        np.random.seed(5)  # another seed: the backup's is the one resumed with
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = resumed.fit(x, y, batch_size=batch_size, epochs=4, shuffle=ours,
                              verbose=0, callbacks=[backup])
    # The optimizer's step count: restored, then one per batch trained.
    return {"epochs": len(history.history["loss"]),
            "order_warnings": [str(w.message) for w in caught
                               if "order is not tracked" in str(w.message)],
            "iterations": int(resumed.optimizer.iterations.numpy()),
            "diff": max_diff(resumed.get_weights(), reference.get_weights()),
            "bytes": resumed.bytes_per_device()}


def multiclient(mesh, directory):
    """One process of a 2-process mesh: unseeded (each process builds other
    initial weights), trained, compared with one device started from the
    weights the sharded model holds (process 0's).

    Runs: momentum and Adam in float32, Adam in float64. Unseeded float32
    Adam is only as close to one device as float32 noise allows: a gradient
    entry near zero whose sign a different summation order flips moves the
    update by up to the learning rate (12 unseeded single-process draws: the
    sharded model 5.6e-7 to 6.6e-5 from one device, one device compiled by
    XLA 1.2e-6 to 5.3e-5 from the same device uncompiled). float64 shows the
    math; float32 Adam is recorded with that noise floor beside it.
    """
    from tensorflow.experimental import dtensor

    rank = dtensor.client_id()
    results = {"clients": np.array(dtensor.num_clients())}
    for name, dtype in (("momentum", "float32"), ("adam", "float32"), ("adam64", "float64")):
        keras.config.set_floatx(dtype)
        keras.config.set_dtype_policy(dtype)
        x, y = data("conv", dtype)
        optimizer = OPTIMIZERS[name.replace("64", "")]
        model = build("conv", optimizer(), seeded=False)
        results[f"{name}_local_initial"] = model.get_weights()[0]
        sharded = kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))
        initial = sharded.get_weights()
        results[f"{name}_initial"] = initial[0]
        reference = build("conv", optimizer(), seeded=False)
        reference.set_weights(initial)
        other = build("conv", optimizer(), seeded=False, jit_compile=True)
        other.set_weights(initial)
        expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                                 validation_data=(x[:8], y[:8])).history
        other.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        got = sharded.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                          validation_data=(x[:8], y[:8])).history
        results[f"{name}_max_diff"] = np.array(
            max_diff(sharded.get_weights(), reference.get_weights()))
        results[f"{name}_noise_floor"] = np.array(
            max_diff(other.get_weights(), reference.get_weights()))
        results[f"{name}_logs_diff"] = np.array(max(
            float(np.max(np.abs(np.array(got[k]) - np.array(expected[k])))) for k in expected))
        for i, weight in enumerate(sharded.get_weights()):
            results[f"{name}_w{i}"] = weight
        results[f"{name}_bytes"] = np.array(
            [sharded.bytes_per_device()[k] for k in ("variables", "replicated_variables")])
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    # A tf.data pipeline shuffled with the same seed on each process, then
    # evaluate and predict (any batch size): against one device.
    x, y = data("conv")

    def pipeline():  # one per model: each pipeline's reshuffles follow its own seed state
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(16, seed=4).batch(
            4, drop_remainder=True)

    model = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    sharded = kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))
    reference = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    reference.set_weights(sharded.get_weights())
    for m in (reference, sharded):
        m.fit(pipeline(), epochs=2, verbose=0)
    results["dataset_max_diff"] = np.array(max_diff(sharded.get_weights(),
                                                    reference.get_weights()))
    evaluated = [m.evaluate(x[:13], y[:13], batch_size=5, verbose=0) for m in (reference, sharded)]
    results["evaluate_diff"] = np.array(abs(evaluated[0] - evaluated[1]))
    predicted = [m.predict(x[:13], batch_size=5, verbose=0) for m in (reference, sharded)]
    results["predict_diff"] = np.array(float(np.abs(predicted[0] - predicted[1]).max()))
    results["predictions"] = predicted[1]
    results.update(shuffled(mesh))
    results.update(written_once(mesh, os.path.join(directory, "files")))
    results.update(resumed_mid_epoch(mesh, os.path.join(directory, "kd_backup")))
    np.savez(os.path.join(directory, f"rank{rank}.npz"), **results)
    loss_matrix(mesh, reference_too=rank == 0)  # its JSON rows, on each process
    print("done", rank, flush=True)


def shuffled(mesh):
    """Keras' default `shuffle=True` on arrays, unseeded processes: the
    order process 0 draws (NumPy's global generator), reshuffled each
    epoch, fed by both. Process 0 draws the same seed again from the state
    it had and trains one device in that order (a one-device
    `DistributedModel`, the same seed); process 1 cannot know it."""
    from tensorflow.experimental import dtensor

    x, y = data("conv")
    model = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    sharded = kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))
    initial = sharded.get_weights()
    state = np.random.get_state()
    history = sharded.fit(x, y, batch_size=8, epochs=3, validation_split=0.25,
                          verbose=0).history
    results = {f"shuffled_w{i}": w for i, w in enumerate(sharded.get_weights())}
    results["shuffled_history"] = np.array([history["loss"], history["val_loss"]])
    if dtensor.client_id() == 0:
        # One device in that order: keras_dist's own shuffle from the same
        # draw (NumPy's generator as it was), each pass ordered by its
        # number; and unshuffled, which must differ.
        for name in ("shuffled", "unshuffled"):
            reference = build("conv", OPTIMIZERS["momentum"](), seeded=False)
            reference.set_weights(initial)
            if name == "shuffled":
                reference = keras_dist.distribute(
                    reference, tf.distribute.OneDeviceStrategy("/cpu:0"))
                np.random.set_state(state)
            fitted = reference.fit(x, y, batch_size=8, epochs=3, validation_split=0.25,
                                   shuffle=name == "shuffled", verbose=0)
            results[f"shuffled_{name}_max_diff"] = np.array(
                max_diff(sharded.get_weights(), reference.get_weights()))
            results[f"shuffled_{name}_history"] = np.array(
                [fitted.history["loss"], fitted.history["val_loss"]])
    return results


def resumed_mid_epoch(mesh, directory):
    """keras_dist's BackupAndRestore (every 3 batches) on the 2-process
    mesh: both processes stop at batch 6 of epoch 2 (a callback raises, as
    a crash would), then a new model (other unseeded weights) with a new
    callback resumes from process 0's backup, mid-epoch. Against one
    device's uninterrupted run from the first model's weights."""
    from keras_dist.callbacks import BackupAndRestore

    x, y = data("conv")  # 32 samples, batch 4: 8 steps per epoch

    def sharded_model():
        model = build("conv", OPTIMIZERS["momentum"](), seeded=False)
        return kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))

    sharded = sharded_model()
    reference = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    reference.set_weights(sharded.get_weights())
    expected = reference.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0).history

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 5:
                raise RuntimeError("crashed at epoch 2, batch 6")

    arguments = dict(batch_size=4, epochs=3, shuffle=False, verbose=0)
    try:
        sharded.fit(x, y, callbacks=[BackupAndRestore(directory, save_freq=3), Crash()],
                    **arguments)
        crashed = False
    except RuntimeError:
        crashed = True
    resumed = sharded_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = resumed.fit(x, y, callbacks=[BackupAndRestore(directory, save_freq=3)],
                              **arguments)
    results = {f"kd_backup_w{i}": w for i, w in enumerate(resumed.get_weights())}
    results.update({
        "kd_backup_crashed": np.array(crashed),
        "kd_backup_epochs": np.array(history.epoch),
        "kd_backup_order_warnings": np.array(
            [str(w.message) for w in caught if "order is not tracked" in str(w.message)]),
        "kd_backup_loss": np.array(history.history["loss"]),
        "kd_backup_expected_loss": np.array(expected["loss"]),
        "kd_backup_max_diff": np.array(max_diff(resumed.get_weights(),
                                                reference.get_weights())),
        "kd_backup_left": np.array(sorted(os.listdir(directory))
                                   if os.path.isdir(directory) else []),
    })
    return results


def written_once(mesh, directory):
    """Keras' file-writing callbacks, progress output and saving on a mesh
    over several processes, as a user's script runs them on every process:
    interrupted after epoch 2 (Keras' BackupAndRestore saved it), then
    resumed by a second fit with the same callbacks. What the job leaves is
    checked by the test; this returns what this process trained and read."""
    x, y = data("conv")
    validation = (x[:8], y[:8])
    model = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    sharded = kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))
    reference = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    reference.set_weights(sharded.get_weights())
    expected = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                             validation_data=validation).history

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted after epoch 2")

    os.makedirs(directory, exist_ok=True)
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv"), append=True),
        keras.callbacks.TensorBoard(os.path.join(directory, "tb")),
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "checkpoint.keras")),
    ]
    try:
        sharded.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=2,
                    validation_data=validation, callbacks=[*callbacks, Interrupt()])
        interrupted = False
    except RuntimeError:
        interrupted = True
    resumed = sharded.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=2,
                          validation_data=validation, callbacks=callbacks)
    weights = sharded.get_weights()
    sharded.save(os.path.join(directory, "final.keras"))
    # Read at once, on every process: save returned once the file was complete.
    loaded = keras.saving.load_model(os.path.join(directory, "final.keras"))
    sharded.save_weights(os.path.join(directory, "final.weights.h5"))
    reference_copy = build("conv", OPTIMIZERS["momentum"](), seeded=False)
    reference_copy.optimizer.build(reference_copy.trainable_variables)
    reference_copy.load_weights(os.path.join(directory, "final.weights.h5"))
    return {
        "files_interrupted": np.array(interrupted),
        "files_resumed_epochs": np.array(resumed.epoch),
        "files_expected_loss": np.array(expected["loss"]),
        "files_expected_val_loss": np.array(expected["val_loss"]),
        "files_resumed_loss": np.array(resumed.history["loss"]),
        "files_resumed_val_loss": np.array(resumed.history["val_loss"]),
        "files_max_diff": np.array(max_diff(weights, reference.get_weights())),
        "files_loaded_diff": np.array(max(max_diff(loaded.get_weights(), weights),
                                          max_diff(reference_copy.get_weights(), weights))),
    }


class Scale(keras.layers.Layer):
    """A user's layer: one weight per feature, no get_config override."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


def recurrent(unroll=True):
    model = keras.Sequential([keras.Input((5, 4)), keras.layers.LSTM(8, unroll=unroll),
                              keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def two_heads():
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([a, b]))
    hidden = keras.layers.Dense(16)(hidden)
    model = keras.Model({"a": a, "b": b}, {
        "reg": keras.layers.Dense(1, name="reg")(hidden),
        "cls": keras.layers.Dense(3, activation="softmax", name="cls")(hidden),
    })
    model.compile(keras.optimizers.Adam(0.01),
                  loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
                  metrics={"cls": ["accuracy"]})
    return model


def custom_layer_and_lambda():
    offset = 0.5  # a closure: the Lambda must keep its own function
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(32), Scale(),
        keras.layers.Lambda(lambda t: keras.ops.relu(t - offset)),
        keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
    return model


def batch_norm():
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
        keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.005), "mse")
    return model


def user_models():
    """Models written the ordinary ways: (name, builder, data)."""
    rs = np.random.RandomState(0)
    yield "dict_two_outputs", two_heads, (
        {"a": rs.randn(32, 6).astype("float32"), "b": rs.randn(32, 4).astype("float32")},
        {"reg": rs.randn(32, 1).astype("float32"), "cls": rs.randint(0, 3, (32,))})
    yield "custom_layer_and_lambda", custom_layer_and_lambda, (
        rs.randn(32, 6).astype("float32"), rs.randn(32, 1).astype("float32"))
    yield "batch_norm", batch_norm, (rs.randn(32, 6).astype("float32") * 3 + 1,
                                     rs.randn(32, 1).astype("float32"))
    yield "lstm_unrolled", recurrent, (rs.randn(32, 5, 4).astype("float32"),
                                       rs.randn(32, 1).astype("float32"))


def user_code(mesh):
    """Each of `user_models` sharded and on one device, built alike (one JSON
    line each): weights, every epoch's logs, evaluate and predict."""
    for name, builder, (x, y) in user_models():
        keras.utils.set_random_seed(2)
        reference = builder()
        keras.utils.set_random_seed(2)
        model = builder()
        sharded = kd.shard(model, mesh, kd.LayoutMapper(mesh, min_elements=0))
        # As users write fit: Keras' default shuffle=True after
        # `keras.utils.set_random_seed` (Keras' order on both), a
        # validation split.
        arguments = dict(batch_size=8, epochs=2, validation_split=0.25, verbose=0)
        keras.utils.set_random_seed(5)
        expected = reference.fit(x, y, **arguments).history
        keras.utils.set_random_seed(5)
        got = sharded.fit(x, y, **arguments).history
        # batch_size 5 does not split over "batch": each batch is padded. One
        # device evaluates with batch 8 (32 samples, no short batch): Keras'
        # per-output loss means count a short last batch as a full one
        # (measured: cls_loss 1.381 with batch 5, 1.344 with 4 or 8); the
        # sharded model's are the means over the samples (1.344 with 5).
        evaluated = [m.evaluate(x, y, batch_size=size, verbose=0, return_dict=True)
                     for m, size in ((reference, 8), (sharded, 5))]
        predicted = [keras.tree.flatten(m.predict(x, batch_size=5, verbose=0))
                     for m in (reference, sharded)]
        print(json.dumps({
            "model": name,
            "sharded": sorted(kd.LayoutMapper(mesh, min_elements=0).layouts(model)),
            "max_diff": max_diff(sharded.get_weights(), reference.get_weights()),
            "log_keys": [sorted(expected), sorted(got)],
            "logs_diff": max(float(np.max(np.abs(np.array(got[k]) - np.array(expected[k]))))
                             for k in expected if k in got),
            "evaluate_keys": [sorted(e) for e in evaluated],
            "evaluate_diff": max(abs(evaluated[0][k] - evaluated[1][k]) for k in evaluated[0]),
            "predict_diff": max_diff(*predicted),
        }), flush=True)


def summed_validation(mesh):
    """A loss summed per batch (its logged mean depends on how the data is
    batched) with Keras' default shuffle after a seed and 40 rows of
    in-memory validation data: validated in fit's batches of 8, as Keras
    validates them (one JSON line: the largest difference of each logged
    number from one device's)."""
    rs = np.random.RandomState(0)
    x, y = rs.randn(48, 6).astype("float32"), rs.randn(48, 1).astype("float32")

    def builder():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.002),
                      keras.losses.MeanSquaredError(reduction="sum"), metrics=["mae"])
        return model

    histories = {}
    for name, model in (("reference", builder()),
                        ("sharded", kd.shard(builder(), mesh,
                                             kd.LayoutMapper(mesh, min_elements=0)))):
        keras.utils.set_random_seed(5)
        histories[name] = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                                    validation_data=(x[:40], y[:40])).history
    expected, got = histories["reference"], histories["sharded"]
    print(json.dumps({
        "keys": [sorted(expected), sorted(got)],
        "diff": {k: float(np.max(np.abs(np.array(got[k]) - np.array(expected[k]))))
                 for k in expected if k in got},
    }), flush=True)


def iterators(mesh):
    """Keras' per-epoch iterators of a sharded fit: a Python generator's torn
    down where Keras drops it (on another thread its teardown can hang), a
    tf.data pipeline's and arrays' on the release thread (a teardown after
    sharded steps blocked for 100-200 ms). One JSON line."""
    from keras_dist._keras_compat import iterators as compat_iterators

    x, y = data("mlp")
    sharded = kd.shard(build("mlp", keras.optimizers.SGD(0.05)), mesh,
                       kd.LayoutMapper(mesh, min_elements=0))

    def generator():
        while True:
            for start in range(0, len(x), 8):
                yield x[start:start + 8], y[start:start + 8]

    queued = []  # the iterators handed to the release thread
    release_later = compat_iterators._release_later
    compat_iterators._release_later = lambda it: (queued.append(1), release_later(it))
    row = {}
    for name, inputs, arguments in (
        ("generator", (generator(),), {"steps_per_epoch": len(x) // 8}),
        ("tf.data", (tf.data.Dataset.from_tensor_slices((x, y)).batch(8),), {}),
        ("arrays", (x, y), {"batch_size": 8}),
    ):
        queued.clear()
        history = sharded.fit(*inputs, epochs=2, verbose=0, **arguments).history
        row[name] = {"losses": history["loss"], "released_in_background": len(queued)}
    compat_iterators._release_later = release_later
    # Every iterator this process handed to the release thread (the earlier
    # steps' too). A teardown can block for up to 60 s by itself (see
    # `lean_epoch_iterators`); on a loaded CI machine the wait passed 60 s.
    started = time.monotonic()
    row["all_released"] = compat_iterators.wait_for_released_iterators(timeout=300)
    row["release_wait_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(row), flush=True)


def errors(mesh, directory):
    """Each bad argument's message, raised before any work (one JSON line)."""
    x, y = classification_data()
    sharded = kd.shard(classifier(), mesh)
    before = sharded.get_weights()
    calls = {
        "batch_size_not_divisible": lambda: sharded.fit(x, y, batch_size=15),
        "last_batch_not_divisible": lambda: sharded.fit(x[:63], y[:63], batch_size=16),
        "y_missing": lambda: sharded.fit(x, batch_size=16),
        "epochs_zero": lambda: sharded.fit(x, y, batch_size=16, epochs=0),
        "y_with_dataset": lambda: sharded.fit(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16), y),
        "dataset_odd_batch": lambda: sharded.fit(
            tf.data.Dataset.from_tensor_slices((x[:63], y[:63])).batch(16)),
        "save_suffix": lambda: sharded.save(os.path.join(directory, "model.h5")),
        "load_missing": lambda: sharded.load_weights(
            os.path.join(directory, "none.weights.h5")),
        "layout_map_type": lambda: kd.shard(classifier(), mesh, {"up/kernel": (None, "model")}),
        "validation_split_last_batch": lambda: sharded.fit(
            x[:60], y[:60], batch_size=16, validation_split=0.05),
        "callback_refused": lambda: sharded.fit(
            x, y, batch_size=16, callbacks=[keras_dist.callbacks.PerReplicaMetrics()]),
        "recurrent_loop": lambda: kd.shard(recurrent(unroll=False), mesh),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except (ValueError, TypeError, FileNotFoundError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    messages["weights_unchanged"] = max_diff(sharded.get_weights(), before)
    print(json.dumps(messages), flush=True)


def matrix_cases():
    """{case: (build, fit arguments)} for `loss_matrix`: every built-in Keras
    loss (probabilities and logits) with the common metrics, sample weights,
    class weights and validation, in 5 models (the many heads in one)."""
    rs = np.random.RandomState(5)
    n, n_val = 32, 16
    x = rs.randn(n + n_val, 16).astype("float32")
    labels = (x[:, :4] + 0.5 * rs.randn(n + n_val, 4)).argmax(1)
    onehot = np.eye(4, dtype="float32")[labels]
    multi = (x[:, 4:8] > 0).astype("float32")  # multi-label targets
    positive = np.abs(x[:, 8:12]) + 0.5  # counts, percentages, log errors
    signs = 2 * multi - 1  # hinge targets
    weights = rs.uniform(0.2, 2.0, n + n_val).astype("float32")
    head = keras.layers.Dense
    heads = {
        # name: (layer, loss, targets, metrics)
        "mse": (head(4), "mean_squared_error", x[:, 12:16],
                ["mean_absolute_error", "root_mean_squared_error", keras.metrics.R2Score()]),
        "mae": (head(4), "mean_absolute_error", x[:, 12:16], []),
        "mape": (head(4), "mean_absolute_percentage_error", positive,
                 ["mean_absolute_percentage_error"]),
        "msle": (head(4, activation="softplus"), "mean_squared_logarithmic_error", positive,
                 ["mean_squared_logarithmic_error"]),
        "cosine": (head(4), "cosine_similarity", x[:, 12:16], ["cosine_similarity"]),
        "huber": (head(4), "huber", x[:, 12:16], []),
        "log_cosh": (head(4), "log_cosh", x[:, 12:16], ["log_cosh_error"]),
        "poisson": (head(4, activation="softplus"), "poisson", positive, ["poisson"]),
        "kl": (head(4, activation="softmax"), "kl_divergence",
               positive / positive.sum(1, keepdims=True), ["kl_divergence"]),
        "bce": (head(4, activation="sigmoid"), "binary_crossentropy", multi,
                ["binary_accuracy", keras.metrics.AUC(), keras.metrics.Precision(),
                 keras.metrics.Recall(), "binary_crossentropy"]),
        "bfocal": (head(4, activation="sigmoid"), "binary_focal_crossentropy", multi, []),
        "cce": (head(4, activation="softmax"), "categorical_crossentropy", onehot,
                ["categorical_accuracy", keras.metrics.TopKCategoricalAccuracy(k=2),
                 "categorical_crossentropy"]),
        # A Softmax layer (its op's input is the logits), as a nested model.
        "cce_softmax_layer": (keras.Sequential([head(4), keras.layers.Softmax()]),
                              "categorical_crossentropy", onehot, []),
        "cfocal": (head(4, activation="softmax"), "categorical_focal_crossentropy", onehot, []),
        "cgce": (head(4, activation="softmax"), keras.losses.CategoricalGeneralizedCrossEntropy(),
                 labels, []),  # integer labels
        "scce": (head(4, activation="softmax"), "sparse_categorical_crossentropy", labels,
                 ["sparse_categorical_accuracy",
                  keras.metrics.SparseTopKCategoricalAccuracy(k=2)]),
        "hinge": (head(4, activation="tanh"), "hinge", signs, ["hinge"]),
        "squared_hinge": (head(4, activation="tanh"), "squared_hinge", signs,
                          ["squared_hinge"]),
        "categorical_hinge": (head(4), "categorical_hinge", onehot, ["categorical_hinge"]),
        "dice": (head(4, activation="sigmoid"), keras.losses.Dice(), multi, []),
        "tversky": (head(4, activation="sigmoid"), keras.losses.Tversky(), multi, []),
        "bce_logits": (head(4), keras.losses.BinaryCrossentropy(from_logits=True), multi,
                       [keras.metrics.BinaryCrossentropy(from_logits=True),
                        keras.metrics.AUC(from_logits=True)]),
        "bfocal_logits": (head(4), keras.losses.BinaryFocalCrossentropy(from_logits=True),
                          multi, []),
        "cce_logits": (head(4), keras.losses.CategoricalCrossentropy(from_logits=True), onehot,
                       [keras.metrics.CategoricalCrossentropy(from_logits=True)]),
        "cfocal_logits": (head(4),
                          keras.losses.CategoricalFocalCrossentropy(from_logits=True),
                          onehot, []),
        "scce_logits": (head(4), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        labels, [keras.metrics.SparseCategoricalCrossentropy(from_logits=True)]),
    }

    def copy(thing):  # a fresh layer / loss / metric object per model built
        return thing if isinstance(thing, str) else thing.__class__.from_config(
            thing.get_config())

    def trunk():
        inputs = keras.Input((16,))
        return inputs, keras.layers.Dense(32, activation="gelu", name="trunk")(inputs)

    def all_heads():
        inputs, h = trunk()
        model = keras.Model(inputs, {name: copy(layer)(h) for name, (layer, *_) in heads.items()})
        # The trunk takes the sum of 26 heads' gradients: a smaller rate.
        model.compile(keras.optimizers.SGD(0.005, momentum=0.9),
                      loss={name: copy(loss) for name, (_, loss, *_) in heads.items()},
                      metrics={name: [copy(m) for m in metrics]
                               for name, (*_, metrics) in heads.items()})
        return model

    def single(layer, loss, metrics):
        def build():
            inputs, h = trunk()
            model = keras.Model(inputs, copy(layer)(h))
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), copy(loss),
                          metrics=[copy(m) for m in metrics])
            return model
        return build

    def circle_model():
        inputs, h = trunk()
        model = keras.Model(inputs, keras.layers.UnitNormalization()(head(8)(h)))
        model.compile(keras.optimizers.SGD(0.005, momentum=0.9), keras.losses.Circle())
        return model

    def ctc_model():
        inputs = keras.Input((6, 8))
        h = keras.layers.Dense(32, activation="gelu", name="trunk")(inputs)
        model = keras.Model(inputs, head(5, activation="softmax")(h))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), keras.losses.CTC())
        return model

    def arguments(x_all, y_all, w_all=None, saturated=False, **more):
        """Fit and evaluate arguments; `saturated`: a validation set scaled
        x30 with its targets reversed (confidently wrong): crossentropies
        read the logits there, not the clipped probabilities."""
        split = lambda tree, part: keras.tree.map_structure(lambda a: a[part], tree)  # noqa: E731
        train, val = slice(0, n), slice(n, None)
        fit = dict(x=x_all[train], y=split(y_all, train), batch_size=8, epochs=2,
                   shuffle=False, verbose=0, **more)
        x_val, y_val = x_all[val], split(y_all, val)
        if saturated:
            x_val, y_val = x_val * 30, split(y_val, slice(None, None, -1))
        evaluate = dict(x=x_val, y=y_val, batch_size=8, verbose=0, return_dict=True)
        if w_all is None:
            fit["validation_data"] = (x_val, y_val)
        else:
            fit["sample_weight"] = w_all[train]
            fit["validation_data"] = (x_val, y_val, w_all[val])
            evaluate["sample_weight"] = w_all[val]
        return fit, evaluate

    sequences = rs.randn(n + n_val, 6, 8).astype("float32")
    # CTC targets: 3 labels from 1..4 (0 is the blank).
    ctc_labels = rs.randint(1, 5, size=(n + n_val, 3)).astype("int32")
    class_weight = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}
    return {
        "all_heads": (all_heads, arguments(x, {k: v[2] for k, v in heads.items()}, weights,
                                           saturated=True)),
        "class_weight": (single(head(4, activation="softmax"),
                                "sparse_categorical_crossentropy", ["accuracy"]),
                         arguments(x, labels, class_weight=class_weight)),
        "class_weight_logits": (single(head(4), keras.losses.CategoricalCrossentropy(
            from_logits=True), ["categorical_accuracy"]),
            arguments(x, onehot, class_weight=class_weight)),
        "circle": (circle_model, arguments(x, labels.astype("int32"), weights)),
        "ctc": (ctc_model, arguments(sequences, ctc_labels)),
    }


def loss_matrix(mesh, reference_too=True, references=None):
    """`matrix_cases` on `mesh` against one device from the same weights (the
    sharded model's, which are process 0's under a launched job): one JSON
    row per case, every history value and evaluate's relative difference,
    and the sharded run's own numbers and a digest of its weights. Without
    `reference_too`, those last only (another process of the same mesh:
    process 0 compares; every collective call in the same order).

    `references`: ("write", DIR) writes each case's initial weights and
    one-device run to DIR; ("read", DIR) starts the sharded model from the
    initial weights found there and compares with the one-device run found
    there (the same computation, trained once for every mesh)."""
    import hashlib
    import pickle

    role, directory = references or (None, None)
    for case, (build, (fit, evaluate)) in matrix_cases().items():
        sharded = kd.shard(build(), mesh, kd.LayoutMapper(mesh, min_elements=0))
        path = directory and os.path.join(directory, f"matrix-{case}.pickle")
        if role == "read":
            with open(wait_for(path), "rb") as f:
                one_device_run = pickle.load(f)
            sharded.set_weights(one_device_run["initial"])
        initial = sharded.get_weights()
        got = sharded.fit(**fit).history
        row = {"case": case, "history": got}
        if reference_too and role == "read":
            reference = build()  # its variables' paths (its weights: one device's)
            reference.set_weights(one_device_run["weights"])
            expected = one_device_run["history"]
            row["expected_evaluate"] = one_device_run["evaluate"]
            row["read_initial_diff"] = max_diff(initial, one_device_run["initial"])
        elif reference_too:
            reference = build()
            reference.set_weights(initial)
            expected = reference.fit(**fit).history
            row["expected_evaluate"] = reference.evaluate(**evaluate)
            if role == "write":
                trained = {"initial": initial, "weights": reference.get_weights(),
                           "history": expected, "evaluate": row["expected_evaluate"]}

                def write(temporary, trained=trained):
                    with open(temporary, "wb") as f:
                        pickle.dump(trained, f)

                publish(path, write)
        row["evaluated"] = sharded.evaluate(**evaluate)
        weights = sharded.get_weights()
        row["weights_digest"] = hashlib.sha256(
            b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
        if reference_too:

            def relative(a, b):
                a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
                return float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b))))

            evaluated = [row["expected_evaluate"], row["evaluated"]]
            row.update({
                "keys": [sorted(expected), sorted(got)],
                "evaluate_keys": [sorted(evaluated[0]), sorted(evaluated[1])],
                "history_diff": {k: relative(got[k], expected[k])
                                 for k in expected if k in got},
                "evaluate_diff": {k: relative(evaluated[1][k], evaluated[0][k])
                                  for k in evaluated[0] if k in evaluated[1]},
                "weights_diff": {v.path: relative(a, b) for v, a, b in zip(
                    reference.weights, weights, reference.get_weights())},
            })
        print(json.dumps(row), flush=True)


def fsdp_model(optimizer):
    """Our own model for fully sharded data parallelism: an embedding, a
    convolution, a LayerNormalization and a Dense pair (seeded)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(64, 16, name="emb")(inputs)
    h = keras.layers.Conv1D(32, 3, activation="relu", name="conv")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu", name="fc")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h), name="fsdp")
    model.compile(optimizer, "mse", metrics=["mae"])
    return model


def fully_sharded(size):
    """FullySharded over a {"batch": size} mesh against one device: one JSON
    row per optimizer (weights, history and predictions differences, the
    layouts, the bytes each device holds)."""
    size = int(size)
    mesh = kd.make_mesh({"batch": size}, [f"cpu:{i}" for i in range(size)])
    rs = np.random.RandomState(6)
    # Each batch of 8 holds every token id once (see `data`: Adam).
    x = np.concatenate([rs.permutation(64).reshape(8, 8) for _ in range(5)]).astype("int32")
    y = rs.randn(40, 4).astype("float32")
    for name in ("momentum", "adam"):
        reference = fsdp_model(OPTIMIZERS[name]())
        sharded = kd.shard(reference, mesh, kd.FullySharded(min_elements=256))
        arguments = dict(batch_size=8, epochs=2, shuffle=False, verbose=0,
                         validation_data=(x[32:], y[32:]))
        expected = reference.fit(x[:32], y[:32], **arguments).history
        got = sharded.fit(x[:32], y[:32], **arguments).history
        print(json.dumps({
            "optimizer": name, "size": size,
            "layouts": {path: list(layout.sharding_specs)
                        for path, layout in sorted(sharded.layouts.items())},
            "max_diff": max_diff(sharded.get_weights(), reference.get_weights()),
            "history_diff": max(float(np.max(np.abs(np.array(got[k]) - np.array(expected[k]))))
                                for k in expected),
            "keys": [sorted(expected), sorted(got)],
            "predict_diff": float(np.abs(sharded.predict(x, 8, verbose=0)
                                         - reference.predict(x, 8, verbose=0)).max()),
            "bytes": sharded.bytes_per_device(),
        }), flush=True)
    # Dropout under FullySharded: the seed generator's state advances once
    # per step, as on one device (each step draws a new mask).
    def dropout_model():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, name="up"),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(4)])
        model.compile(OPTIMIZERS["momentum"](), "mse")
        return model

    def seed_states(variables):
        return [np.asarray(v.value if hasattr(v, "value") else v).tolist()
                for v in variables if "seed_generator_state" in v.path]

    reference = dropout_model()
    sharded = kd.shard(reference, mesh, kd.FullySharded(min_elements=256))
    before = seed_states(sharded.__keras_dist_backup_variables__()["model"])
    xd, yd = rs.randn(32, 16).astype("float32"), rs.randn(32, 4).astype("float32")
    for model in (sharded, reference):
        model.fit(xd, yd, batch_size=8, epochs=1, shuffle=False, verbose=0)
    print(json.dumps({"dropout": True, "size": size, "before": before,
                      "after": seed_states(sharded.__keras_dist_backup_variables__()["model"]),
                      "one_device_after": seed_states(reference.variables)}), flush=True)


def with_references(args, function, otherwise):
    """`function(references=(role, DIR))` for an argument `write:DIR` or
    `read:DIR` (a writer that fails tells the readers, who stop waiting),
    `otherwise()` for any other."""
    role, _, directory = args[0].partition(":") if args else ("", "", "")
    if role not in ("write", "read"):
        return otherwise()
    os.makedirs(directory, exist_ok=True)
    try:
        function(references=(role, directory))
    except BaseException as error:
        if role == "write":
            with open(os.path.join(directory, "failed"), "w") as f:
                f.write(repr(error))
        raise


def run(mode, mesh, args):
    if mode == "golden":
        # golden MESH [KIND,...] or golden MESH write:DIR / read:DIR
        with_references(args, lambda **kw: golden(mesh, **kw),
                        lambda: golden(mesh, args[0].split(",") if args else KINDS))
    elif mode == "layout_map":
        keras_layout_map(mesh)
    elif mode == "user_code":
        user_code(mesh)
    elif mode == "summed_validation":
        summed_validation(mesh)
    elif mode == "loss_matrix":
        # loss_matrix MESH [write:DIR|read:DIR]
        with_references(args, lambda **kw: loss_matrix(mesh, **kw), lambda: loss_matrix(mesh))
    elif mode == "fully_sharded":
        fully_sharded(args[0])
    elif mode == "multiclient":
        multiclient(mesh, args[0])
    elif mode == "callbacks":
        callbacks(mesh, args[0])
    elif mode == "resume_copies":
        resume_copies(mesh, args[0])
    elif mode == "backup_killed":
        backup_killed(mesh, args[0])
    elif mode == "kd_backup_killed":
        backup_killed(mesh, args[0], ours=True)
    elif mode == "save":
        save(mesh, args[0])
    elif mode == "load":
        load(mesh, args[0])
    elif mode == "iterators":
        iterators(mesh)
    elif mode == "errors":
        errors(mesh, args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    mode, mesh_name = sys.argv[1], sys.argv[2]
    shape = MESHES[mesh_name]
    if os.environ.get("TF_CONFIG"):
        # As docs/model_parallel.md shows it: the default devices, every
        # process's numbered globally.
        mesh = kd.make_mesh(shape)
    else:
        mesh = kd.make_mesh(
            shape, [f"cpu:{i}" for i in range(int(np.prod(list(shape.values()))))])
    if mode == "steps":
        # Several modes one after another on one mesh in one process (one
        # TensorFlow start): `steps MESH MODE[=ARG] ...`, each mode's lines
        # after a {"step": MODE} line.
        for step in sys.argv[3:]:
            if step.startswith("callbacks="):
                import atexit

                # However this process ends (an earlier step failing too),
                # the process resuming the callbacks' copies stops waiting.
                marker = os.path.join(step.partition("=")[2], WRITER_EXITED)
                atexit.register(lambda path=marker: open(path, "w").close())
        for step in sys.argv[3:]:
            name, _, arg = step.partition("=")
            print(json.dumps({"step": name}), flush=True)
            started = time.perf_counter()
            run(name, mesh, [arg] if arg else [])
            # Where the time goes (the suite's budget): on stderr.
            print(f"step {name} took {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
    else:
        run(mode, mesh, sys.argv[3:])
