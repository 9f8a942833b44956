"""`keras_dist.dtensor.initialize`: one call before TensorFlow starts."""

import os
import subprocess
import sys

import pytest

from keras_dist.dtensor import initialize

SCRIPT = """
import os, sys
import keras_dist.dtensor as kd
if sys.argv[1] == "late":
    import tensorflow as tf
    tf.constant(1.0) + 1
    try:
        kd.initialize(None)
    except RuntimeError as e:
        print("RuntimeError:", e)
else:
    print("devices", kd.initialize(4))
    from tensorflow.experimental import dtensor
    mesh = dtensor.create_mesh([("batch", 2), ("model", 2)], device_type="CPU")
    print("mesh", mesh.num_local_devices())
"""


def run(mode):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env,
                          capture_output=True, text=True, timeout=120)


def test_initialize_before_tensorflow_starts_gives_a_mesh():
    done = run("ok")
    assert "devices 4" in done.stdout and "mesh 4" in done.stdout, done.stderr[-2000:]


def test_initialize_too_late_says_so():
    done = run("late")
    assert "RuntimeError: keras_dist.dtensor.initialize() must run before" in done.stdout, (
        done.stdout + done.stderr[-2000:])


@pytest.mark.parametrize("kwargs, message", [
    ({"device_type": "NPU"}, "device_type='NPU'"),
    ({"num_devices": 2, "device_type": "GPU"}, "only splits a CPU"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        initialize(**kwargs)
