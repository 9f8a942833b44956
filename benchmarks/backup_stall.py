"""Scenario 4: per-save stall and disk of BackupAndRestore, keras_dist's vs Keras' own.

Trains the same model three ways side by side in one process (no backup,
`keras.callbacks.BackupAndRestore`, `keras_dist.callbacks.BackupAndRestore`),
both callbacks saving every step, and reports the extra time per save and
the disk used per backup. Timing is taken after a warm-up epoch.

Usage: python -m benchmarks.backup_stall [--steps 40] [--width 512] [--repeats 5]
"""

import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _common  # noqa: E402
from keras_dist.callbacks import BackupAndRestore  # noqa: E402


def build(width):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def disk_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def timed_fit(width, x, y, steps, callback_factory):
    model = build(width)
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0)  # warm-up
    backup_dir = tempfile.mkdtemp()
    callbacks = [callback_factory(backup_dir)] if callback_factory else []
    start = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=callbacks)
    seconds = time.perf_counter() - start
    shutil.rmtree(backup_dir, ignore_errors=True)
    return seconds, model


def backup_size(width, x, y, factory, pick):
    model = build(width)
    backup_dir = tempfile.mkdtemp()
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[factory(backup_dir)])
    size = pick(backup_dir)
    shutil.rmtree(backup_dir, ignore_errors=True)
    return size, model.count_params()


def resumed_fit(width, x, y, steps, factory):
    """Seconds of a fit that resumes epoch 2 of 2 from a backup of epoch 1.

    Without `factory`: the same epoch from `initial_epoch=1`, nothing restored.
    """
    backup_dir = tempfile.mkdtemp()
    if factory:
        build(width).fit(x, y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0,
                         callbacks=[factory(backup_dir)])
    model = build(width)
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0)  # warm-up
    callbacks = [factory(backup_dir)] if factory else []
    start = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=2, initial_epoch=0 if factory else 1,
              steps_per_epoch=steps, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - start
    shutil.rmtree(backup_dir, ignore_errors=True)
    return seconds


def run(args) -> dict:
    steps = 4 if args.quick else args.steps
    rs = np.random.RandomState(0)
    x = rs.randn(64 * steps, 256).astype("float32")
    y = rs.randn(64 * steps, 10).astype("float32")
    variants = {
        "no backup": None,
        "keras.callbacks.BackupAndRestore(save_freq=1)":
            lambda d: keras.callbacks.BackupAndRestore(d, save_freq=1, delete_checkpoint=False),
        "keras_dist.callbacks.BackupAndRestore(save_freq=1)":
            lambda d: BackupAndRestore(d, save_freq=1, delete_checkpoint=False),
    }
    times = _common.interleave(
        {name: (lambda f=factory: timed_fit(args.width, x, y, steps, f)[0])
         for name, factory in variants.items()},
        _common.repeats(args, 5), warmup=0,
    )
    base = min(times["no backup"])
    restores = _common.interleave({
        "none": lambda: resumed_fit(args.width, x, y, steps, None),
        "keras": lambda: resumed_fit(args.width, x, y, steps, lambda d: (
            keras.callbacks.BackupAndRestore(d, delete_checkpoint=False))),
        "ours": lambda: resumed_fit(args.width, x, y, steps, lambda d: BackupAndRestore(
            d, delete_checkpoint=False)),
    }, _common.repeats(args, 5), warmup=0)
    restore_base = min(restores["none"])
    # A difference of run times: below the timer's noise it can come out
    # negative; it is reported as at least 0.01 ms.
    restore_ms = {
        "no backup": 0.0,
        "keras.callbacks.BackupAndRestore(save_freq=1)":
            max((statistics.median(restores["keras"]) - restore_base) * 1e3, 0.01),
        "keras_dist.callbacks.BackupAndRestore(save_freq=1)":
            max((statistics.median(restores["ours"]) - restore_base) * 1e3, 0.01),
    }

    def newest_backup(d):
        names = sorted(n for n in os.listdir(d) if n.startswith("backup-"))
        return disk_bytes(os.path.join(d, names[-1]))

    ours, params = backup_size(args.width, x, y, variants[
        "keras_dist.callbacks.BackupAndRestore(save_freq=1)"], newest_backup)
    theirs, _ = backup_size(args.width, x, y, variants[
        "keras.callbacks.BackupAndRestore(save_freq=1)"], disk_bytes)
    disk = {"no backup": 0, "keras.callbacks.BackupAndRestore(save_freq=1)": theirs,
            "keras_dist.callbacks.BackupAndRestore(save_freq=1)": ours}
    # Stall per save: (time with saves - best time without) / saves.
    rows = [_common.row(name, [(t - base) / steps for t in values], 1e3,
                        disk_mb_per_backup=disk[name] / 1e6,
                        restore_ms=restore_ms[name])
            for name, values in times.items()]
    return {
        "id": 4, "name": "backup_stall",
        "title": "BackupAndRestore: stall per save and disk per backup vs Keras' own",
        "setup": (
            f"Default strategy (one CPU device); MLP 256-{args.width}-{args.width}-10 "
            f"({params:,} parameters) with Adam, batch 64, a save after every one of "
            f"{steps} steps, fresh model and backup directory per run (each run's "
            "warm-up epoch untimed), interleaved; stall = (run - best run without "
            "backup) / saves. Restore: a fit resuming epoch 2 of 2 from an end-of-epoch "
            "backup (save_freq=\"epoch\") minus the same epoch trained without one "
            "(medians)."
        ),
        "unit": "ms stall/save", "rows": rows,
        "ratios": [{"name": "stall per save, keras_dist / Keras",
                    "value": rows[2]["median"] / rows[1]["median"]},
                   {"name": "restore time, keras_dist / Keras",
                    "value": rows[2]["restore_ms"] / max(rows[1]["restore_ms"], 1e-9)}],
        "notes": "keras_dist's save adds fsync of every file, a sha256 manifest, an "
                 "atomic rename and pointer, and the extra state (metrics, seeds, input "
                 f"position, callbacks). Float32 weights + Adam slots: "
                 f"{3 * params * 4 / 1e6:.2f} MB.",
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=512)
    _common.main(run, __doc__, p)
