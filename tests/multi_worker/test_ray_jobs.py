"""keras_dist inside Ray Train's `TensorflowTrainer`, on a real local Ray cluster.

The test starts a Ray head and a second Ray node (the `ray` command of the
`ray[train]` extra) inside a network namespace of their own where only the
loopback interface exists: Ray maps 127.0.0.1 to the host's own address
when it has one, so there every address it hands out is 127.0.0.1. The
namespace's processes die with it. tests/multi_worker/ray_main.py runs the
training (one Ray worker per node) and prints the outcome.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from keras_dist import _netns

pytestmark = pytest.mark.multi_worker

SCRIPT = os.path.join(os.path.dirname(__file__), "ray_main.py")
CLUSTER = """
set -e
ip link set lo up
export RAY_USAGE_STATS_ENABLED=0
NODE="--node-ip-address=127.0.0.1 --num-cpus=2 --object-store-memory=80000000"
ray start --head --port=6379 --temp-dir="$RAY_TMP" --include-dashboard=false \
    --disable-usage-stats $NODE > "$WORK/head.log" 2>&1
ray start --address=127.0.0.1:6379 $NODE > "$WORK/node.log" 2>&1
exec "$PYTHON" "$SCRIPT" 127.0.0.1:6379 "$WORK"
"""


def unhidden_path() -> str:
    """PYTHONPATH without tests/_hidden (see conftest.py): Ray Train imports pandas."""
    hidden = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_hidden")
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != hidden)


def namespace_command() -> list[str]:
    flags = ["--net", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        flags.append("--map-root-user")
    return ["unshare", *flags, "bash", "-c", CLUSTER]


def test_a_ray_worker_killed_mid_epoch_resumes_exactly_from_the_runs_backup(tmp_path):
    pytest.importorskip("ray.train.tensorflow")
    reason = _netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespace for a loopback-only Ray cluster: {reason}")
    ray_tmp = tempfile.mkdtemp(prefix="kd-ray-")  # Ray's socket paths must stay short
    try:
        done = subprocess.run(
            namespace_command(), capture_output=True, text=True, timeout=900,
            env=dict(os.environ, WORK=str(tmp_path), RAY_TMP=ray_tmp, SCRIPT=SCRIPT,
                     PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
                     PYTHONPATH=unhidden_path()))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    logs = "".join((tmp_path / n).read_text()[-2000:] for n in ("head.log", "node.log")
                   if (tmp_path / n).exists())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:] + logs
    [line] = [line for line in done.stdout.splitlines() if line.startswith("{")]
    report = json.loads(line)
    # Two Ray nodes, every address Ray and TensorFlow use on the loopback.
    assert report["nodes"] == ["127.0.0.1", "127.0.0.1"]
    for name in ("uninterrupted", "killed"):
        run = report[name]
        assert run["error"] is None, run["error"]
        ranks = run["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["node"] != ranks[1]["node"]  # one Ray worker per node
        for r in ranks:
            assert r["num_workers"] == 2
            assert r["strategy"].startswith("MultiWorkerMirroredStrategy: 2 replicas, 2 workers")
            workers = r["tf_config"]["cluster"]["worker"]
            assert len(workers) == 2 and all(a.startswith("127.0.0.1:") for a in workers)
        # RayReport: the result's metrics are the last epoch's logs.
        last = ranks[0]["last_logs"]
        assert run["metrics"] == {"loss": pytest.approx(last["loss"], rel=1e-6),
                                  "validation_loss": pytest.approx(last["val_loss"], rel=1e-6),
                                  "epoch": 3}
        # ... and its checkpoint holds the final weights (the same values).
        assert run["checkpoint_files"] == ["model.weights.h5"]
        reported = np.sort(np.concatenate([np.ravel(w) for w in run["checkpoint_weights"]]))
        final = np.sort(np.concatenate([np.ravel(w) for w in ranks[0]["weights"]]))
        np.testing.assert_array_equal(reported, final)
        # Unseeded shuffle, seeded initial weights: both ranks hold one model.
        first, second = ([np.array(w) for w in r["weights"]] for r in ranks)
        assert max(np.abs(a - b).max() for a, b in zip(first, second)) == 0.0
    uninterrupted, killed = report["uninterrupted"]["ranks"], report["killed"]["ranks"]
    assert [r["epochs_run"] for r in uninterrupted] == [3, 3]
    assert all(r["first_attempt"] for r in uninterrupted)
    # Ray restarted the group after worker 1's SIGKILL (epoch 2, step 6) and
    # keras_dist resumed it from its last backup, in epoch 2: epochs 2 and 3 only.
    assert [r["first_attempt"] for r in killed] == [False, False]
    assert [r["epochs_run"] for r in killed] == [2, 2]
    diff = max(np.abs(np.array(a) - np.array(b)).max()
               for a, b in zip(uninterrupted[0]["weights"], killed[0]["weights"]))
    assert diff < 1e-6, diff
    for name in ("loss", "val_loss", "mae", "val_mae"):  # the last epoch's logs too
        assert killed[0]["last_logs"][name] == pytest.approx(
            uninterrupted[0]["last_logs"][name], rel=1e-5), name
