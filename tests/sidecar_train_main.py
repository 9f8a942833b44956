"""The training side of tests/test_sidecar.py: 3 epochs, three kinds of
checkpoints, each epoch held until the evaluator has evaluated its backup."""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist.callbacks import BackupAndRestore

work = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.random((256, 6)).astype("float32")
y = x @ rng.random((6, 1)).astype("float32")
model = keras_dist.distribute(keras.Sequential([
    keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]))
model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
manager = tf.train.CheckpointManager(
    tf.train.Checkpoint(model=model, optimizer=model.optimizer),
    os.path.join(work, "manager"), max_to_keep=2)


class HeldUntilEvaluated(keras.callbacks.Callback):
    """Writes the epoch's weights, then waits for the evaluator's word."""

    def on_epoch_end(self, epoch, logs=None):
        np.savez(os.path.join(work, f"weights-{epoch + 1}.npz"), *self.model.get_weights())
        manager.save(checkpoint_number=epoch + 1)
        evaluated = os.path.join(work, f"evaluated-{epoch + 1}")
        deadline = time.monotonic() + 300
        while not os.path.exists(evaluated):
            if time.monotonic() > deadline:
                sys.exit(f"the evaluator did not evaluate epoch {epoch + 1}")
            time.sleep(0.05)


model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[
    BackupAndRestore(os.path.join(work, "backups"), delete_checkpoint=False),
    keras.callbacks.ModelCheckpoint(os.path.join(work, "files", "ckpt-{epoch}.weights.h5"),
                                    save_weights_only=True),
    HeldUntilEvaluated(),
])
print("trained", flush=True)
