"""Collectives and rank logic (`keras_dist._collectives`), checked directly."""

import keras
import pytest
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist import _collectives


def run_on_replicas(make_gradient):
    """Runs `agree_on_finite` on 4 replicas; returns each replica's output."""
    strategy = keras_dist.resolve_strategy("mirrored")
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            rid = tf.cast(context.replica_id_in_sync_group, tf.float32)
            (out,) = _collectives.agree_on_finite(
                optimizer, [make_gradient(rid)], context
            )
            return out

        return strategy.run(replica_fn)

    return [v.numpy() for v in strategy.experimental_local_results(step())]


def test_replicas_agree_when_one_has_non_finite_gradients():
    # Only replica 2 overflows; every replica must skip the step.
    outputs = run_on_replicas(
        lambda rid: tf.where(tf.equal(rid, 2.0), np.inf, 1.0) * tf.ones([3])
    )
    assert [bool(np.all(np.isfinite(o))) for o in outputs] == [False] * 4


def test_finite_gradients_are_left_alone():
    for value in run_on_replicas(lambda rid: tf.ones([3]) * 2.0):
        np.testing.assert_array_equal(value, [2.0, 2.0, 2.0])


def test_plain_optimizers_are_untouched():
    g = [tf.constant([np.inf])]
    assert _collectives.agree_on_finite(keras.optimizers.SGD(), g, None) is g


def test_broadcast_from_chief_counts_each_worker_once():
    # One worker with 4 replicas: the value comes back as it went in (each
    # worker's first replica contributes, not every replica).
    broadcast = _collectives.broadcast_from_chief(keras_dist.resolve_strategy("mirrored"))
    np.testing.assert_array_equal(broadcast(np.array([1.5, -2.0], "float32")), [1.5, -2.0])
    np.testing.assert_array_equal(broadcast(np.array([3.0, 0.0], "float32")), [3.0, 0.0])


def test_agreements_on_one_worker_are_the_values_themselves():
    strategy = keras_dist.resolve_strategy("mirrored")
    assert _collectives.agree_sum(strategy, [3, 0, 7]) == [3, 0, 7]
    assert _collectives.agree_any(strategy, [True, False]) == [True, False]
    assert not _collectives.is_multi_worker(strategy)


def small_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def files_and_times(directory):
    return {p.name: p.stat().st_mtime_ns for p in sorted(directory.iterdir())}


def test_keras_backup_is_written_and_deleted_by_the_chief_only(tmp_path, monkeypatch):
    """Keras' own BackupAndRestore, one shared backup_dir: a worker that is
    not the chief restores from it but never writes or deletes it (two
    workers both deleting it at the end of training raised
    FileNotFoundError)."""
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    shared = tmp_path / "backup"
    chief = small_model()
    chief.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(shared), delete_checkpoint=False)])
    before = files_and_times(shared)
    assert "training_metadata.json" in before

    monkeypatch.setattr(_collectives, "is_multi_worker", lambda strategy: True)
    monkeypatch.setattr(_collectives, "is_chief", lambda strategy: False)
    user_callback = keras.callbacks.BackupAndRestore(str(shared), save_freq=1)
    paths = dict(vars(user_callback))
    (worker_callback,) = _collectives.callbacks_for_this_worker(None, [user_callback])
    worker = small_model()
    history = worker.fit(x, y, batch_size=4, epochs=4, verbose=0,
                         callbacks=[worker_callback])
    # Restored from the shared backup (epoch 2), written elsewhere, and the
    # shared backup (which the chief deletes) left as it was.
    assert history.epoch == [2, 3]
    assert files_and_times(shared) == before
    assert {k: vars(user_callback)[k] for k in paths if "path" in k or k == "backup_dir"} \
        == {k: v for k, v in paths.items() if "path" in k or k == "backup_dir"}

    # A fit that raises leaves the callback's paths as the user made them.
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    (worker_callback,) = _collectives.callbacks_for_this_worker(None, [user_callback])
    with pytest.raises(RuntimeError, match="boom"):
        small_model().fit(x, y, batch_size=4, epochs=4, verbose=0,
                          callbacks=[worker_callback, Boom()])
    assert user_callback.backup_dir == str(shared)
    assert user_callback._weights_path == str(shared / "latest.weights.h5")
    assert files_and_times(shared) == before
