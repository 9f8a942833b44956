"""Golden equivalence and memory of `keras_dist.dtensor.shard`.

Each mesh runs in its own process: DTensor must start before TensorFlow,
and (measured here) a process that trained on a 2-device mesh hung on a
4-device one.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "golden_main.py")


@pytest.mark.parametrize("mesh", ["model2", "model4", "batch2_model2"])
def test_sharded_training_matches_one_device_and_shards_memory(mesh):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, SCRIPT, mesh], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["optimizer"] for row in rows] == ["sgd", "momentum", "adam"]
    for row in rows:
        # 2 epochs of 4 steps of the MLP 8-32-16-1, Dense(1) head included.
        assert row["max_diff"] < 1e-5, row
        assert row["predict_diff"] < 1e-5, row
        # up (8x32 + 32) and down (32x16) are sharded over "model"; the
        # down bias and the head (16 + 16 + 1) stay replicated. Measured
        # from the shard each device holds.
        n = row["mesh"]["model"]
        sharded = 4 * (8 * 32 + 32 + 32 * 16)
        assert row["bytes_replicated_variables"] == sharded + 4 * 33
        assert row["bytes_variables"] == sharded // n + 4 * 33
        if row["optimizer"] == "adam":  # slots take their variable's layout
            assert row["bytes_optimizer"] == 2 * row["bytes_variables"] + (
                row["bytes_replicated_optimizer"] - 2 * row["bytes_replicated_variables"])
