"""ResourceMonitor on 4 logical CPUs (host figures) and with a mocked GPU."""

from unittest import mock

import keras
import numpy as np
import pytest
from helpers import mlp, regression_data

import keras_dist
from keras_dist.callbacks import ResourceMonitor
from keras_dist.callbacks import resource_monitor as module


def fit(callback, epochs=2, strategy="mirrored"):
    x, y = regression_data(n=64)
    model = keras_dist.distribute(mlp(), strategy=strategy)
    model.compile("sgd", "mse")
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[callback])


def test_host_memory_and_cpu_in_the_epoch_logs():
    history = fit(ResourceMonitor()).history
    rss, peak = history["memory/host_rss_mb"], history["memory/host_peak_rss_mb"]
    assert len(rss) == 2 and all(r > 10 for r in rss)  # a TensorFlow process
    assert all(p >= r for p, r in zip(peak, rss))
    assert all(0.0 <= c <= 100.0 * 64 for c in history["utilization/host_cpu_percent"])
    assert not any(k.startswith("memory/GPU") for k in history)  # CPUs only here


def test_batch_reports_and_chief_prints(capsys):
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, "memory/host_rss_mb" in logs))

    x, y = regression_data(n=64)
    model = keras_dist.distribute(mlp(), strategy="mirrored")
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[ResourceMonitor(update_freq=2, verbose=1), Spy()])
    assert seen == [(0, False), (1, True), (2, False), (3, True)]
    out = capsys.readouterr().out
    assert out.count("ResourceMonitor batch") == 2 and "ResourceMonitor epoch 1" in out


def test_accelerator_memory_is_read_and_its_peak_reset():
    info = {"current": 3 * 2**20, "peak": 5 * 2**20}
    with mock.patch.object(module, "_accelerators", return_value=["GPU:0", "GPU:1"]), \
            mock.patch("tensorflow.config.experimental.get_memory_info",
                       return_value=info) as read, \
            mock.patch("tensorflow.config.experimental.reset_memory_stats") as reset:
        history = fit(ResourceMonitor(), epochs=1).history
    assert history["memory/GPU_0_mb"] == [3.0] and history["memory/GPU_1_peak_mb"] == [5.0]
    assert [c.args[0] for c in read.call_args_list] == ["GPU:0", "GPU:1"]
    assert reset.call_count == 4  # at the start and after each report


@pytest.mark.parametrize("kwargs, message", [
    ({"update_freq": 0}, "Received: update_freq=0"),
    ({"update_freq": "batch"}, "Received: update_freq='batch'"),
    ({"verbose": 2}, "Received: verbose=2"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResourceMonitor(**kwargs)


def test_accelerators_of_a_cpu_strategy_are_none():
    assert module._accelerators(keras_dist.resolve_strategy("mirrored")) == []
    assert np.isfinite(module._host_rss())
