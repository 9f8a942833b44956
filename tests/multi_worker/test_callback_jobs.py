"""Tier 2: LearningRateScaler and PerReplicaMetrics in a 2-worker job."""

import os

import numpy as np
import pytest

from multi_worker._cluster import run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(__file__), "worker_main.py")


def test_both_callbacks_on_two_workers(tmp_path):
    out = tmp_path / "job"
    outputs = run_workers(WORKER, ["callbacks", str(out), "slow=1"])
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        # 2 replicas: the rate after the 4-step warmup is 2 x 0.01.
        np.testing.assert_allclose(got["learning_rate"], [0.02, 0.02], rtol=1e-6)
        np.testing.assert_array_equal(got["samples__replica_0"], [32.0, 32.0])
        np.testing.assert_array_equal(got["samples__replica_1"], [32.0, 32.0])
        # The global loss is the mean of the two workers' shard losses.
        np.testing.assert_allclose(
            got["loss"], (got["loss__replica_0"] + got["loss__replica_1"]) / 2,
            rtol=1e-5,
        )
        assert (got["step_time__worker_0"] > 0).all()
    # Worker 1 sleeps 150 ms after each step; worker 0 waits for it in the
    # barrier before the input, so only worker 1's step time carries it, and
    # the chief names it. (Over the run: on a loaded 2-core machine one
    # epoch's figures were once seen equal.)
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        slow, fast = got["step_time__worker_1"], got["step_time__worker_0"]
        assert slow.mean() > fast.mean() + 0.05, (slow, fast)
        assert slow.min() > 0.15
        np.testing.assert_allclose(
            got["step_time_ratio"], np.maximum(slow, fast) / np.minimum(slow, fast),
            rtol=1e-5)
    assert "worker 1 is a straggler" in outputs[0]
    assert "straggler" not in outputs[1]
    # Both workers ran the same collectives (the job finished) and the chief
    # wrote its CSV.
    assert (out / "replicas.csv").exists()
