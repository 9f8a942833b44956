"""Tier 1: keras_dist.tuner in one process (strategy per trial, errors)."""

import copy
import importlib.util
import socket
import subprocess
import sys
import time
from unittest import mock

import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.callbacks import LearningRateScaler
from keras_dist.tuner import DistributedTuner, RandomSearch

from helpers import max_abs_diff

SEEN = []  # what each build and fit saw; module level: callbacks are deep-copied


def data(n=64, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, 6).astype("float32")
    y = (x @ rs.randn(6, 1)).astype("float32")
    return x, y


def build_model(hp):
    SEEN.append(("build", tf.distribute.get_strategy().num_replicas_in_sync))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(hp.Choice("units", [8]), activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.SGD(hp.Fixed("lr", 0.01)), "mse")
    return model


class Record(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        SEEN.append((
            "fit",
            isinstance(self.model, keras_dist.DistributedModel),
            self.model.distribute_strategy.num_replicas_in_sync,
            logs.get("learning_rate"),
        ))


def test_each_trial_runs_on_the_strategy_and_matches_one_device(tmp_path):
    SEEN.clear()
    strategy = keras_dist.resolve_strategy("mirrored")
    replicas = strategy.num_replicas_in_sync
    x, y = data()
    tuner = RandomSearch(build_model, objective="loss", max_trials=1,
                         directory=tmp_path, project_name="p", strategy=strategy)
    tuner.search(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                 callbacks=[LearningRateScaler(base_batch_size=4), Record()])
    builds = [s for s in SEEN if s[0] == "build"]
    fits = [s for s in SEEN if s[0] == "fit"]
    # Search-space discovery and the trial both build under the strategy.
    assert builds and all(b[1] == replicas for b in builds)
    # LearningRateScaler applies per trial: 0.01 x 16 / 4.
    assert [f[:3] for f in fits] == [("fit", True, replicas)] * 2
    np.testing.assert_allclose([f[3] for f in fits], [0.04, 0.04], rtol=1e-6)
    # The trained trial equals the same training (rate 0.04) on one device.
    best = tuner.get_best_models(1)[0]
    hp = keras_tuner.HyperParameters()
    hp.Fixed("lr", 0.04)
    reference = build_model(hp)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_abs_diff(best.get_weights(), reference.get_weights()) < 1e-5
    trial = tuner.oracle.get_best_trials(1)[0]
    assert trial.status == "COMPLETED"


def test_works_without_tensorboard(tmp_path):
    tuner = RandomSearch(build_model, objective="loss", max_trials=1,
                         directory=tmp_path, project_name="p")
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs"))
    trial = keras_tuner.engine.trial.Trial(keras_tuner.HyperParameters(), trial_id="3")
    with mock.patch.object(importlib.util, "find_spec", return_value=None):
        tuner._configure_tensorboard_dir([board], trial, 1)
    assert board.log_dir == str(tmp_path / "logs" / "3" / "execution1")


def test_callbacks_can_be_deep_copied_per_trial():
    from keras_dist.callbacks import PerReplicaMetrics

    for callback in (LearningRateScaler(warmup_epochs=1), PerReplicaMetrics()):
        assert type(copy.deepcopy(callback)) is type(callback)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"distribution_strategy": tf.distribute.get_strategy()}, "strategy="),
        ({"connect_timeout": 0}, "connect_timeout=0"),
        ({"call_timeout": -1.0}, "call_timeout=-1.0"),
        ({"heartbeat_interval": "5"}, "heartbeat_interval='5'"),
        ({"worker_timeout": 10, "heartbeat_interval": 5}, "worker_timeout=10"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandomSearch(build_model, objective="loss", max_trials=1,
                     directory=tmp_path, project_name="p", **kwargs)
    assert not (tmp_path / "p").exists()


def test_unreachable_oracle_fails_within_connect_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "KERASTUNER_TUNER_ID": "tuner0",
        "KERASTUNER_ORACLE_IP": "127.0.0.1",
        "KERASTUNER_ORACLE_PORT": str(port),
    }
    start = time.monotonic()
    with mock.patch.dict("os.environ", env):
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*connect_timeout=1s"):
            RandomSearch(build_model, objective="loss", max_trials=1,
                         directory=tmp_path, project_name="p", connect_timeout=1)
    assert time.monotonic() - start < 30


def test_a_long_wait_for_the_oracle_is_said_once(tmp_path, monkeypatch, capsys):
    from keras_dist.tuner import _oracle

    monkeypatch.setattr(_oracle, "_WAIT_NOTICE_AFTER", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"KERASTUNER_TUNER_ID": "tuner0", "KERASTUNER_ORACLE_IP": "127.0.0.1",
           "KERASTUNER_ORACLE_PORT": str(port)}
    with mock.patch.dict("os.environ", env):
        with pytest.raises(ConnectionError, match="connect_timeout=2s"):
            RandomSearch(build_model, objective="loss", max_trials=1,
                         directory=tmp_path, project_name="p", connect_timeout=2)
    out = capsys.readouterr().out
    assert out.count(f"waiting for the oracle at 127.0.0.1:{port} (the chief) to answer, "
                     "up to connect_timeout=2s") == 1, out


def test_mixin_on_a_user_tuner(tmp_path):
    class Search(DistributedTuner, keras_tuner.GridSearch):
        pass

    SEEN.clear()
    x, y = data()
    tuner = Search(build_model, objective="loss", max_trials=1,
                   directory=tmp_path, project_name="p", strategy="mirrored")
    tuner.search(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Record()])
    assert [s[1] for s in SEEN if s[0] == "fit"] == [True]


def test_import_without_keras_tuner_names_the_extra():
    code = (
        "import sys; sys.modules['keras_tuner'] = None\n"
        "try:\n"
        "    import keras_dist.tuner\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert 'pip install "keras-dist[tuner]"' in out.stdout, out.stderr


def wide_space(hp):
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(hp.Int("units", 4, 512), activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-4, 1e-1, sampling="log")), "mse")
    return model


@pytest.mark.parametrize("kind", ["RandomSearch", "BayesianOptimization"])
def test_seed_zero_draws_the_same_trials_every_run(tmp_path, kind):
    # keras-tuner alone treats seed=0 as no seed (a random one per run).
    tuner_class = getattr(keras_dist.tuner, kind)

    def draws(seed, directory):
        tuner = tuner_class(wide_space, objective="loss", max_trials=3, seed=seed,
                            directory=tmp_path / directory, project_name="p")
        return tuner.oracle.seed, [
            tuner.oracle.create_trial(f"tuner{i}").hyperparameters.values
            for i in range(3)
        ]

    first, second = draws(0, "a"), draws(0, "b")
    assert first[0] == 0 and first == second
    assert draws(7, "c") == draws(7, "d")
    assert draws(7, "e") != first


def test_a_resumed_search_keeps_its_seed(tmp_path):
    # A search started by keras-tuner with seed=0 drew its own random seed;
    # resuming it under keras_dist keeps that seed (and its trials).
    old = keras_tuner.RandomSearch(wide_space, objective="loss", max_trials=3, seed=0,
                                   directory=tmp_path, project_name="p")
    old.oracle.create_trial("tuner0")
    old.save()
    resumed = RandomSearch(wide_space, objective="loss", max_trials=3, seed=0,
                           directory=tmp_path, project_name="p", overwrite=False)
    assert resumed.oracle.seed == old.oracle.seed != 0
    assert list(resumed.oracle.trials) == list(old.oracle.trials)


def test_the_private_oracle_attributes_set_for_seed_zero_exist():
    from keras_dist.tuner import _kt_compat

    for owner, names in _kt_compat.ATTRIBUTES.items():
        module, name = owner.rsplit(".", 1)
        oracle = getattr(importlib.import_module(module), name)(objective="loss", seed=3)
        missing = [n for n in names if not hasattr(oracle, n)]
        assert not missing, f"keras-tuner renamed {owner}.{missing}: update _kt_compat.py"
