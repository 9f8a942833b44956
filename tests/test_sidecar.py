"""`keras_dist.SidecarEvaluator`: an evaluator process beside a training one."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import sidecar

TRAINER = os.path.join(os.path.dirname(__file__), "sidecar_train_main.py")
VAL_X = np.random.default_rng(1).random((64, 6)).astype("float32")
VAL_Y = VAL_X.sum(axis=1, keepdims=True)


def evaluator_model():
    """The evaluator's own copy of the trained architecture (other initial weights)."""
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def expected(work, epoch):
    """What evaluating the weights training had after `epoch` gives."""
    model = evaluator_model()
    with np.load(os.path.join(work, f"weights-{epoch}.npz")) as saved:
        model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
    return model.evaluate(VAL_X, VAL_Y, verbose=0, return_dict=True)


class Acknowledge(keras.callbacks.Callback):
    """Tells the trainer each evaluation is done (the trainer waits for it)."""

    def __init__(self, work):
        super().__init__()
        self.work, self.count = work, 0

    def on_test_end(self, logs=None):
        self.count += 1
        open(os.path.join(self.work, f"evaluated-{self.count}"), "w").close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training process whose epochs the evaluator follows as they end."""
    work = str(tmp_path_factory.mktemp("sidecar"))
    # An unseeded random draw of this process's own: Keras' global
    # SeedGenerator exists here and not in the trainer (it was once
    # compared as part of the model: "the backup has 4 variables, the
    # model 5", after another module's tests in the same process).
    keras.random.uniform((1,))
    trainer = subprocess.Popen(
        [sys.executable, TRAINER, work], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        evaluator = keras_dist.SidecarEvaluator(
            evaluator_model(), (VAL_X, VAL_Y), os.path.join(work, "backups"),
            callbacks=[Acknowledge(work)], poll_interval=0.1, timeout=300)
        history = evaluator.start()
        output, _ = trainer.communicate(timeout=300)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, output[-3000:]
    return work, history


def test_every_epochs_backup_is_evaluated_as_training_writes_it(trained, capsys):
    work, history = trained
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert [h["iterations"] for h in history] == [8, 16, 24]  # the step training was at
    for record in history:
        want = expected(work, record["epoch"])
        for name in ("loss", "mae"):
            assert record[name] == pytest.approx(want[name], rel=1e-6), (record, want)
    # The epoch-3 backup ended the loop: it is the last of its fit.
    assert os.path.basename(history[-1]["checkpoint"]) == "backup-00000003"


@pytest.mark.parametrize("directory", ["files", "manager"])
def test_keras_files_and_checkpoint_managers_are_evaluated_up_to_max_evaluations(
        trained, directory, capsys):
    work, _ = trained
    evaluator = keras_dist.SidecarEvaluator(
        evaluator_model(), (VAL_X, VAL_Y), os.path.join(work, directory), max_evaluations=3,
        poll_interval=0.1, timeout=60)
    [record] = evaluator.start()  # the newest only: written before the evaluator started
    assert record["epoch"] == 3
    want = expected(work, 3)
    assert record["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert record["mae"] == pytest.approx(want["mae"], rel=1e-6)
    assert "reached max_evaluations=3" in capsys.readouterr().out


def test_waiting_is_said_once_and_a_timeout_ends_the_loop(tmp_path, capsys):
    evaluator = keras_dist.SidecarEvaluator(
        evaluator_model(), (VAL_X, VAL_Y), tmp_path, poll_interval=0.05, timeout=0.6)
    assert evaluator.start() == []
    out = capsys.readouterr().out
    assert out.count(f"SidecarEvaluator: waiting for a checkpoint in {tmp_path}") == 1
    assert re.search(r"stopped after 0 evaluation\(s\): no new checkpoint for \d+s", out)


def test_a_model_of_another_architecture_is_refused(trained):
    work, _ = trained
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    other.compile("sgd", "mse")
    evaluator = keras_dist.SidecarEvaluator(other, (VAL_X, VAL_Y), os.path.join(work, "backups"))
    with pytest.raises(TypeError, match=re.escape(
            "are not of this model (model: the backup has 4 variables, the model 2")):
        evaluator.start()


@pytest.mark.parametrize("kwargs, message", [
    (dict(checkpoint_dir=""), "Invalid value for argument `checkpoint_dir`"),
    (dict(steps=0), "Invalid value for argument `steps`. Expected a positive integer. "
                    "Received: steps=0"),
    (dict(max_evaluations=1.5), "Received: max_evaluations=1.5"),
    (dict(timeout=float("inf")), "Invalid value for argument `timeout`. Expected a positive, "
                                 "finite number of seconds. Received: timeout=inf"),
    (dict(poll_interval=0), "Received: poll_interval=0"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    arguments = dict(model=evaluator_model(), data=(VAL_X, VAL_Y), checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        keras_dist.SidecarEvaluator(**{**arguments, **kwargs})


def test_an_unbuilt_model_is_refused_before_waiting(tmp_path):
    model = keras.Sequential([keras.layers.Dense(1)], name="unbuilt")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match=re.escape(
            "Received: model 'unbuilt', not built. Build it first")):
        keras_dist.SidecarEvaluator(model, (VAL_X, VAL_Y), tmp_path, timeout=60).start()


def test_files_that_never_load_raise_after_three(tmp_path, capsys):
    # Each new file of another architecture may be one that training is
    # rewriting: the first two are skipped (said), the third raises.
    staging, watched = tmp_path / "staging", tmp_path / "watched"
    staging.mkdir()
    watched.mkdir()
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    other.save_weights(str(staging / "other.weights.h5"))

    def training_writes():
        for epoch in (1, 2, 3):
            time.sleep(0.5)
            target = watched / f"ckpt-{epoch}.weights.h5"
            shutil.copy(staging / "other.weights.h5", target)
            os.utime(target, (time.time() + epoch, time.time() + epoch))

    writer = threading.Thread(target=training_writes)
    writer.start()
    evaluator = keras_dist.SidecarEvaluator(evaluator_model(), (VAL_X, VAL_Y), watched,
                                            poll_interval=0.05, timeout=60)
    try:
        with pytest.raises(ValueError, match="could not be loaded"):
            evaluator.start()
    finally:
        writer.join()
    out = capsys.readouterr().out
    assert out.count("SidecarEvaluator: skipped ckpt-") == 2, out
    assert "training may be writing or removing it: looking again" in out


@pytest.mark.parametrize("name, epoch", [
    ("ckpt-3.weights.h5", 3), ("model.07-0.45.keras", 7), ("ckpt-12", 12), ("model.keras", None),
])
def test_a_files_number_is_the_first_in_its_name(name, epoch):
    assert sidecar._epoch_in_name(f"/runs/run2/{name}") == epoch


def test_an_uncompiled_model_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)], name="plain")
    with pytest.raises(ValueError, match=re.escape(
            "Received: an uncompiled model 'plain'. Call model.compile(")):
        keras_dist.SidecarEvaluator(model, (VAL_X, VAL_Y), tmp_path)
