"""Per-save stall of BackupAndRestore: keras_dist's versus Keras' own.

Trains the same model three ways side by side in one process (no backup,
`keras.callbacks.BackupAndRestore`, `keras_dist.callbacks.BackupAndRestore`),
both callbacks saving every step, and reports the extra time per save and
the disk used per backup. Timing is taken after a warm-up epoch.

Usage: python benchmarks/backup_stall.py [--steps 40] [--width 512] [--repeats 3]
"""

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rs = np.random.RandomState(0)
    x = rs.randn(64 * args.steps, 256).astype("float32")
    y = rs.randn(64 * args.steps, 10).astype("float32")
    variants = {
        "no backup": None,
        "keras BackupAndRestore(save_freq=1)": lambda d: keras.callbacks.BackupAndRestore(
            d, save_freq=1, delete_checkpoint=False),
        "keras_dist BackupAndRestore(save_freq=1)": lambda d: BackupAndRestore(
            d, save_freq=1, delete_checkpoint=False),
    }
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):  # interleaved, best of N
        for name, factory in variants.items():
            seconds, _ = timed_fit(args.width, x, y, args.steps, factory)
            best[name] = min(best[name], seconds)
    base = best["no backup"]
    print(f"{args.steps} steps, width {args.width}, best of {args.repeats}")
    for name, seconds in best.items():
        stall = (seconds - base) / args.steps * 1000
        print(f"  {name:42s} {seconds:7.3f} s   stall/save {stall:7.2f} ms")
    ours = best["keras_dist BackupAndRestore(save_freq=1)"] - base
    theirs = best["keras BackupAndRestore(save_freq=1)"] - base
    print(f"  stall ratio keras_dist / keras: {ours / theirs:.2f}")

    def newest_backup(d):
        names = sorted(n for n in os.listdir(d) if n.startswith("backup-"))
        return disk_bytes(os.path.join(d, names[-1]))

    size, params = backup_size(args.width, x, y, variants[
        "keras_dist BackupAndRestore(save_freq=1)"], newest_backup)
    keras_size, _ = backup_size(args.width, x, y, variants[
        "keras BackupAndRestore(save_freq=1)"], disk_bytes)
    print(f"  disk per backup: keras_dist {size / 1e6:.2f} MB, keras {keras_size / 1e6:.2f} MB"
          f" ({params} parameters + Adam slots = {3 * params * 4 / 1e6:.2f} MB of float32)")


if __name__ == "__main__":
    main()
