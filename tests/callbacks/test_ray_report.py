"""`RayReport` outside Ray Train, and its arguments (inside: tests/multi_worker/test_ray_jobs.py)."""

import re

import keras
import numpy as np
import pytest

from keras_dist.callbacks import RayReport

pytest.importorskip("ray.train")


def test_outside_a_ray_train_worker_the_fit_is_refused_before_a_step():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(RuntimeError, match=re.escape(
            "RayReport reports to Ray Train and runs only inside a Ray Train worker")):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[RayReport()])
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("metrics, kept", [
    (None, None), (["loss", "val_loss"], {"loss": "loss", "val_loss": "val_loss"}),
    ({"validation_loss": "val_loss"}, {"validation_loss": "val_loss"}),
])
def test_metrics_forms(metrics, kept):
    assert RayReport(metrics).metrics == kept


@pytest.mark.parametrize("metrics", ["loss", [1], {"a": 1}, 5])
def test_bad_metrics_are_refused(metrics):
    with pytest.raises(TypeError, match=re.escape(
            f"Invalid type for argument `metrics`. Expected None, a list of log names or a "
            f"dict {{reported name: log name}}. Received: metrics={metrics!r}")):
        RayReport(metrics)
