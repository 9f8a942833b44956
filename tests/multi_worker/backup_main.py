"""A training job that backs up with BackupAndRestore and can be killed.

Usage: backup_main.py OUT_DIR BACKUP_DIR [key=value ...]
Options: input=numpy|dataset, spe=N, freq=epoch|N, epochs=N, batch=B (global),
replicas=R (one process: R logical CPUs), dropout=RATE, bn=1 (BatchNormalization),
kill=K / term=K (SIGKILL / SIGTERM this process after its K-th trained call,
on rank `victim`, default 0), sleep=S (seconds after each trained call,
until OUT_DIR/unpaced exists: a test done disturbing the job lets it end;
while OUT_DIR/held exists, every worker waits after its step),
seconds=S (save_every_seconds),
killsave=K:STAGE (SIGKILL this process inside its K-th backup save: STAGE
`files` = every file written, no manifest; `rename` = sealed, not renamed
into place; `pointer` = renamed, `latest` not yet updated).
Appends `save K` / `agree K` to OUT_DIR/events-rank{R}.txt for each backup
save and each collective keras_dist issues outside the steps (an
agreement), K the steps trained by then. Writes OUT_DIR/rank{R}.npz (final weights) when training ends, and appends
one line per trained step to OUT_DIR/ids-rank{R}.txt:
`epoch step id id ...` (the sample ids the step trained on, all replicas),
after a `start` line per process.
"""

import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

import keras_dist  # noqa: E402

_replicas = dict(a.split("=", 1) for a in sys.argv[3:]).get("replicas", "2")
if "TF_CONFIG" not in os.environ:
    keras_dist.simulate_replicas(int(_replicas))
strategy = keras_dist.resolve_strategy("auto")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_dist.callbacks import BackupAndRestore  # noqa: E402
from keras_dist.strategy import worker_info  # noqa: E402

out_dir, backup_dir = sys.argv[1], sys.argv[2]
opts = dict(a.split("=", 1) for a in sys.argv[3:])
if "killsave" in opts:
    from keras_dist import _backup_store

    _kill_at, _stage = opts["killsave"].split(":")
    _saves = {"n": 0}

    def _die_at(stage):
        if stage == _stage and _saves["n"] == int(_kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

    _seal, _commit, _replace = _backup_store.seal, _backup_store.commit, os.replace

    def _sealing(directory):
        _saves["n"] += 1
        _die_at("files")
        return _seal(directory)

    def _committing(tmp_dir, backup_dir, sequence):
        _die_at("rename")
        return _commit(tmp_dir, backup_dir, sequence)

    def _replacing(src, dst, *args, **kwargs):
        if os.path.basename(str(dst)) == _backup_store.POINTER:
            _die_at("pointer")
        return _replace(src, dst, *args, **kwargs)

    _backup_store.seal, _backup_store.commit = _sealing, _committing
    _backup_store.os.replace = _replacing
rank = worker_info(strategy).rank
os.makedirs(out_dir, exist_ok=True)

# Every collective keras_dist issues outside the training step, counted.
from keras_dist import _collectives  # noqa: E402

_agree_sum = _collectives.agree_sum


def _event(kind):
    with open(os.path.join(out_dir, f"events-rank{rank}.txt"), "a") as f:
        f.write(f"{kind} {calls}\n")


def _counted_agree_sum(*args, **kwargs):
    _event("agree")
    return _agree_sum(*args, **kwargs)


_collectives.agree_sum = _counted_agree_sum
N = 48
BATCH = int(opts.get("batch", 8))  # the global batch


class Net(keras_dist.DistributedModel):
    """Regression on features 1..6; feature 0 is the sample id."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.drop = keras.layers.Dropout(float(opts.get("dropout", 0.2)))
        self.norm = keras.layers.BatchNormalization() if opts.get("bn") else None
        self.out = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        hidden = self.hidden(inputs[:, 1:])
        if self.norm is not None:
            hidden = self.norm(hidden, training=training)
        return self.out(self.drop(hidden, training=training))

    def train_step(self, data):
        logs = super().train_step(data)
        ids = tf.cast(data[0][:, 0], tf.int32)
        logs["ids"] = tf.reduce_sum(tf.one_hot(ids, N), axis=0)
        return logs


rs = np.random.RandomState(0)
features = rs.randn(N, 6).astype("float32")
y = (features @ rs.randn(6, 1)).astype("float32")
x = np.concatenate([np.arange(N, dtype="float32")[:, None], features], axis=1)

keras.utils.set_random_seed(1)
# Only the weights seeded: keras_dist draws and records the shuffle's seed
# (with TensorFlow's global seed set, arrays would train in Keras' one order).
tf.random.set_seed(None)
model = Net(strategy=strategy)
model.compile(keras.optimizers.Adam(0.02), "mse",
              steps_per_execution=int(opts.get("spe", 1)))
calls = 0
with open(os.path.join(out_dir, f"ids-rank{rank}.txt"), "a") as f:
    f.write("start\n")


class Tally(keras.callbacks.Callback):
    """Records what each trained step saw; kills the process on cue."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        global calls
        if "ids" not in logs:  # a step the resumed run skips
            return
        calls += 1
        if True:
            counts = np.rint(np.asarray(logs["ids"]) * strategy.num_replicas_in_sync)
            ids = [str(i) for i in np.repeat(np.arange(N), counts.astype(int))]
            with open(os.path.join(out_dir, f"ids-rank{rank}.txt"), "a") as f:
                f.write(f"{self.epoch} {batch} {' '.join(ids)}\n")
        # A slower step, for jobs disturbed from outside.
        if "sleep" in opts and not os.path.exists(os.path.join(out_dir, "unpaced")):
            time.sleep(float(opts["sleep"]))
        # Held at a step boundary while OUT_DIR/held exists (alive, not advancing).
        while os.path.exists(os.path.join(out_dir, "held")):
            time.sleep(0.05)
        if rank == int(opts.get("victim", 0)):
            if calls == int(opts.get("kill", -1)):
                os.kill(os.getpid(), signal.SIGKILL)
            if calls == int(opts.get("term", -1)):
                os.kill(os.getpid(), signal.SIGTERM)


freq = opts.get("freq", "3")
backup = BackupAndRestore(
    backup_dir,
    save_freq="epoch" if freq == "epoch" else int(freq),
    save_every_seconds=float(opts["seconds"]) if "seconds" in opts else None,
)
_save = backup._save


def _counted_save(*args, **kwargs):
    _event("save")
    return _save(*args, **kwargs)


backup._save = _counted_save
fit_args = dict(epochs=int(opts.get("epochs", 3)), verbose=0,
                callbacks=[Tally(), backup])
if opts.get("input", "numpy") == "numpy":
    model.fit(x, y, batch_size=BATCH, shuffle=True, **fit_args)
else:
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=5).batch(BATCH)
    model.fit(ds, **fit_args)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), *model.get_weights())
print("done", flush=True)
