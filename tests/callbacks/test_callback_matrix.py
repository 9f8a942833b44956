"""Tier 1: every keras_dist callback with every built-in Keras callback and optimizer.

Each case fits one model on 2 replicas with one keras_dist callback, all of
Keras' built-in callbacks that run without a server (so each triple keras_dist
callback x Keras callback x optimizer meets in one fit), saves `.keras` files
at epoch ends and mid-epoch, loads them back and trains the loaded model on.
"""

import csv

import keras
import numpy as np
import pytest

import keras_dist
from helpers import max_abs_diff
from helpers import mlp
from helpers import regression_data
from helpers import two_replicas
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks import LearningRateScaler
from keras_dist.callbacks import PerReplicaMetrics
from keras_dist.callbacks import ResourceMonitor

EPOCHS = 3
BATCH = 16  # global: 8 per replica, 3 steps per epoch on 48 training samples

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.02, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.005),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
}

KERAS_DIST_CALLBACKS = {
    "BackupAndRestore": lambda tmp: BackupAndRestore(tmp / "backup", save_freq=2),
    "LearningRateScaler": lambda tmp: LearningRateScaler(
        warmup_steps=4, momentum_correction=True, verbose=1
    ),
    "PerReplicaMetrics": lambda tmp: PerReplicaMetrics(
        update_freq=2, csv_path=tmp / "replicas.csv"
    ),
    "ResourceMonitor": lambda tmp: ResourceMonitor(update_freq=2),
}


def keras_callbacks(tmp, seen):
    """Every built-in Keras callback that needs no server, as users set them."""
    return [
        keras.callbacks.ModelCheckpoint(tmp / "epoch.keras"),
        keras.callbacks.ModelCheckpoint(tmp / "best.keras", save_best_only=True),
        keras.callbacks.ModelCheckpoint(tmp / "batch.keras", save_freq=2),
        keras.callbacks.ModelCheckpoint(
            tmp / "epoch.weights.h5", save_weights_only=True
        ),
        keras.callbacks.EarlyStopping(patience=10, restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(patience=1, factor=0.5, min_delta=1e9),
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate),
        keras.callbacks.CSVLogger(str(tmp / "log.csv")),
        keras.callbacks.TensorBoard(tmp / "tb", histogram_freq=1, update_freq=2),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen.append(dict(logs))
        ),
        keras.callbacks.ProgbarLogger(),
    ]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("callback", sorted(KERAS_DIST_CALLBACKS))
def test_callback_with_keras_callbacks_and_optimizer(tmp_path, callback, optimizer):
    x, y = regression_data(n=64)
    model = keras_dist.distribute(mlp(), strategy=two_replicas())
    model.compile(OPTIMIZERS[optimizer](), "mse", metrics=["mae"])
    seen = []
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_split=0.25,
        callbacks=[KERAS_DIST_CALLBACKS[callback](tmp_path)]
        + keras_callbacks(tmp_path, seen),
        verbose=0,
    )

    assert len(history.history["loss"]) == EPOCHS
    assert len(seen) == EPOCHS and all(np.isfinite(s["val_loss"]) for s in seen)
    assert np.all(np.isfinite(history.history["loss"]))
    with open(tmp_path / "log.csv") as f:
        assert len(list(csv.DictReader(f))) == EPOCHS
    assert any((tmp_path / "tb").rglob("*.v2"))
    # ReduceLROnPlateau halved the rate each epoch after the first.
    assert history.history["learning_rate"][-1] < history.history["learning_rate"][0]

    # The last epoch's .keras file and weights file hold the same weights and
    # the optimizer as compiled (its class, built rate and step count).
    built = OPTIMIZERS[optimizer]()
    reference = mlp()
    reference.load_weights(tmp_path / "epoch.weights.h5")
    for name in ("epoch.keras", "batch.keras", "best.keras"):
        loaded = keras.saving.load_model(tmp_path / name)
        assert type(loaded.optimizer) is type(built), name
        assert np.all([np.all(np.isfinite(w)) for w in loaded.get_weights()]), name
    loaded = keras.saving.load_model(tmp_path / "epoch.keras")
    assert max_abs_diff(loaded.get_weights(), reference.get_weights()) == 0.0
    assert int(loaded.optimizer.iterations.numpy()) == EPOCHS * 3
    config = loaded.optimizer.get_config()
    assert config["learning_rate"] <= built.get_config()["learning_rate"]
    if optimizer == "sgd_momentum":
        assert config["momentum"] == 0.9

    # The loaded model trains on, on the strategy, with the same callbacks
    # (for the callbacks that act on the optimizer or on saved state).
    if callback not in ("BackupAndRestore", "LearningRateScaler"):
        return
    (tmp_path / "again").mkdir()
    before = loaded.get_weights()
    loaded = keras_dist.distribute(loaded, strategy=two_replicas())
    loaded.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS + 1,
        initial_epoch=EPOCHS,
        callbacks=[KERAS_DIST_CALLBACKS[callback](tmp_path / "again")]
        + keras_callbacks(tmp_path / "again", []),
        verbose=0,
    )
    assert int(loaded.optimizer.iterations.numpy()) == EPOCHS * 3 + 4
    assert max_abs_diff(loaded.get_weights(), before) > 0.0
    assert np.all([np.all(np.isfinite(w)) for w in loaded.get_weights()])
