"""One worker of scenario 10 (run alone to write the starting backup, or by
`keras-dist launch --min-workers 1`).

Trains the digits MLP on 64 samples (global batch 16: 4 steps an epoch)
with keras_dist's `BackupAndRestore` (a backup every epoch) for `--epochs`
epochs. Rank 0 appends `time pid epoch step` to `<out>/steps.txt` after every
step; every worker writes `<out>/rank<r>.pid` when it starts. With
`--stop-at E` (one process, no job), it exits once epoch E begins and the
backup of epoch E-1's end is written: the backup a job then resumes from.
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
parser.add_argument("out")
parser.add_argument("backup_dir")
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--stop-at", type=int, default=None)
args = parser.parse_args()

rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))

import keras  # noqa: E402

import keras_dist  # noqa: E402
from benchmarks import _common  # noqa: E402

x, y = _common.digits(64)
# No seed set anywhere: keras_dist shuffles with the seed the chief draws.
model = _common.compile_model(keras_dist.distribute(keras.Sequential([
    keras.Input((8, 8, 1)), keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10),
])))
backup = keras_dist.callbacks.BackupAndRestore(args.backup_dir)


class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = 0
        self.file = open(os.path.join(args.out, "steps.txt"), "a") if rank == 0 else None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if args.stop_at is not None and epoch >= args.stop_at:
            backup.wait_until_finished()
            os._exit(0)

    def on_train_batch_end(self, batch, logs=None):
        if self.file is not None:
            self.file.write(f"{time.time():.4f} {os.getpid()} {self.epoch} {batch}\n")
            self.file.flush()


model.fit(x, y, batch_size=16, epochs=args.epochs, verbose=0, callbacks=[backup, Steps()])
