"""Tier 1: PerReplicaMetrics on 4 logical-CPU replicas."""

import csv
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from helpers import Crash
from keras_dist.callbacks import PerReplicaMetrics, per_replica_metrics

# Replica r gets samples with x = 1 and y = r + 1 (4 replicas, batch 4,
# unshuffled): with a zero kernel and a zero rate, its loss is (r + 1)^2,
# its absolute error r + 1 and its local gradient norm 2 (r + 1).
X = np.ones((16, 1), "float32")
Y = np.tile(np.arange(1, 5, dtype="float32"), 4)[:, None]


def zero_model(spe=1):
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = keras_dist.DistributedModel(inputs, dense(inputs), strategy="mirrored")
    model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"],
                  steps_per_execution=spe)
    return model


@pytest.mark.parametrize("spe", [1, 2])
def test_per_replica_values_have_closed_forms(spe):
    model = zero_model(spe)
    for _ in range(2):  # two fits in a row
        history = model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                            callbacks=[PerReplicaMetrics(gradient_norm=True)])
        h = history.history
        for r in range(4):
            assert h[f"loss/replica_{r}"] == [pytest.approx((r + 1) ** 2)] * 2
            assert h[f"mae/replica_{r}"] == [pytest.approx(r + 1)] * 2
            assert h[f"grad_norm/replica_{r}"] == [pytest.approx(2 * (r + 1))] * 2
            assert h[f"samples/replica_{r}"] == [4.0, 4.0]
        # The global metric is the mean of the per-replica values.
        assert h["loss"] == [pytest.approx(7.5)] * 2
        assert h["step_time/worker_0"][0] > 0
        assert h["samples_per_sec/worker_0"][0] > 0
        assert h["step_time_ratio"] == [1.0, 1.0]
    # A fit without the callback traces a step without the collectives.
    history = model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert sorted(history.history) == ["loss", "mae"]


def test_chief_writes_csv_and_summaries_without_tensorboard(tmp_path):
    model = zero_model()
    path, log_dir = tmp_path / "r" / "m.csv", tmp_path / "tb"
    model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0,
              callbacks=[PerReplicaMetrics(2, csv_path=path, log_dir=log_dir)])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["step"]) for r in rows] == [
        ("0", "2"), ("0", "4"), ("1", "6"), ("1", "8")
    ]
    assert float(rows[-1]["loss/replica_3"]) == pytest.approx(16.0)
    assert float(rows[0]["samples/replica_0"]) == 2.0
    tags = set()
    for name in os.listdir(log_dir):
        for event in tf.compat.v1.train.summary_iterator(str(log_dir / name)):
            tags.update(v.tag for v in event.summary.value)
    assert {"loss/replica_0", "step_time/worker_0", "samples/replica_3"} <= tags


def test_plain_keras_model_is_refused_at_train_begin():
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match="keras_dist.distribute"):
        model.fit(X, Y, verbose=0, callbacks=[PerReplicaMetrics()])


def test_gradient_norm_needs_the_built_in_train_step():
    class Custom(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

        def train_step(self, data):
            return super().train_step(data)

    model = Custom(strategy="mirrored")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="gradient_norm=False"):
        model.fit(X, Y, batch_size=4, verbose=0,
                  callbacks=[PerReplicaMetrics(gradient_norm=True)])
    history = model.fit(X, Y, batch_size=4, shuffle=False, verbose=0,
                        callbacks=[PerReplicaMetrics()])
    assert len([k for k in history.history if k.startswith("loss/")]) == 4


def test_straggler_is_named_once_per_episode():
    callback = PerReplicaMetrics(straggler_steps=5)
    callback._run = per_replica_metrics._Run(chief=True)
    slow = (np.array([0.01, 0.01, 0.05]), 1.0)
    with pytest.warns(UserWarning, match="worker 2 is a straggler"):
        callback._check_stragglers(slow)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback._check_stragglers(slow)  # same episode: no second warning
    callback._check_stragglers((np.array([0.01, 0.01, 0.01]), 1.0))
    with pytest.warns(UserWarning, match="worker 2"):
        callback._check_stragglers(slow)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(update_freq=0), ValueError, "update_freq=0"),
        (dict(update_freq="batch"), ValueError, "update_freq='batch'"),
        (dict(csv_path=""), ValueError, "csv_path=''"),
        (dict(gradient_norm="yes"), TypeError, "gradient_norm='yes'"),
        (dict(straggler_factor=1), ValueError, "straggler_factor=1"),
        (dict(straggler_steps=0), ValueError, "straggler_steps=0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        PerReplicaMetrics(**kwargs)


def test_path_arguments_are_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match="`csv_path`: it is a directory"):
        PerReplicaMetrics(csv_path=tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="`log_dir`: it exists and is not a directory"):
        PerReplicaMetrics(log_dir=tmp_path / "file")


def test_a_resumed_run_continues_the_step_axis_of_its_csv(tmp_path):
    """get_state/set_state: after a crash and a resume, the CSV holds the
    rows of an uninterrupted run (steps neither restart nor repeat)."""
    data = dict(x=X, y=Y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    whole = tmp_path / "whole.csv"
    zero_model().fit(**data, callbacks=[PerReplicaMetrics(1, csv_path=whole)])
    path, backup_dir = tmp_path / "m.csv", str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        zero_model().fit(**data, callbacks=[
            keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=4),
            PerReplicaMetrics(1, csv_path=path),
            Crash(7),
        ])
    with open(path) as f:
        assert [r["step"] for r in csv.DictReader(f)][-1] == "7"
    zero_model().fit(**data, callbacks=[
        keras_dist.callbacks.BackupAndRestore(backup_dir, save_freq=4),
        PerReplicaMetrics(1, csv_path=path),
    ])

    def steps(p):
        with open(p) as f:
            return [(r["epoch"], r["step"]) for r in csv.DictReader(f)]

    assert steps(path) == steps(whole)
    assert steps(whole)[-1] == ("2", "12")


def test_each_worker_step_time_comes_from_its_own_clock():
    """Two workers, one replica each, 4 steps. Worker 0 waited 3 s for
    worker 1, 1 s of it before the reading worker's window began: its step
    time is its own elapsed time minus its own waits, never the reader's
    window minus its waits (which was negative, logged as 0)."""
    run = per_replica_metrics._Run(workers=2, per_worker=1)
    # Columns: samples, waited, steps, elapsed (per replica, in the graph).
    start = np.zeros([2, 4], np.float32)
    totals = np.array([[16, 3.0, 4, 3.4], [16, 0.0, 4, 2.8]], np.float32)
    window = per_replica_metrics._Window(100.0, start)
    step_times, wall = window.worker_times(102.5, totals, run)
    np.testing.assert_allclose(step_times, [0.1, 0.7], rtol=1e-6)
    np.testing.assert_allclose(wall, [3.4, 2.8], rtol=1e-6)
    # At an epoch's end each worker's time after its last step (its last
    # batch's callbacks) counts too.
    step_times, wall = window.worker_times(102.5, totals, run, tails=[0.0, 0.4])
    np.testing.assert_allclose(step_times, [0.1, 0.8], rtol=1e-6)
    np.testing.assert_allclose(wall, [3.4, 3.2], rtol=1e-6)
