"""Runs every example in its smoke mode and checks what it reports."""

import os
import re
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_quickstart_learns_digits_on_two_replicas():
    out = run_example("quickstart.py", "--smoke")
    assert "MirroredStrategy: 2 replicas, 1 worker (rank 0, chief)" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.5  # chance is 0.1 on 10 classes


def test_quickstart_on_two_launched_workers():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         os.path.join(EXAMPLES, "quickstart.py"), "--smoke"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert (
            f"[worker {rank}] MultiWorkerMirroredStrategy: 2 replicas, 2 workers "
            f"(rank {rank}" in done.stdout
        )
    accuracies = re.findall(r"\[worker \d\] test loss [0-9.]+  test accuracy ([0-9.]+)",
                            done.stdout)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert float(accuracies[0]) > 0.5


def test_tuner_search_alone_on_two_replicas(tmp_path):
    out = run_example("tuner_search.py", "--smoke", "--directory", str(tmp_path))
    assert "2 trials completed" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.3  # chance is 0.1; one epoch of the best of 2 trials


def test_tuner_search_with_two_tuner_workers(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "tune", "--num-workers", "2",
         os.path.join(EXAMPLES, "tuner_search.py"), "--smoke",
         "--directory", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[chief] 2 trials completed" in done.stdout
    accuracy = float(re.search(r"\[chief\] best model: test accuracy ([0-9.]+)",
                               done.stdout).group(1))
    assert accuracy > 0.3


def test_model_parallel_trains_sharded_on_four_logical_cpus():
    out = run_example("model_parallel.py", "--smoke")
    assert "mesh: batch=2 x model=2 over 4 CPU devices" in out
    first, last = map(float, re.search(r"first loss ([0-9.]+)  last loss ([0-9.]+)", out).groups())
    assert last < first
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.3  # chance is 0.1; two epochs
    reloaded = float(re.search(r"reloaded test accuracy ([0-9.]+)", out).group(1))
    assert reloaded == accuracy
    used, whole = (int(v.replace(",", "")) for v in
                   re.search(r"variables ([0-9,]+) of ([0-9,]+)", out).groups())
    assert used < 0.6 * whole  # the large layers are split in two
