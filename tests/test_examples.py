"""Runs every example in its smoke mode and checks what it reports."""

import os
import re
import subprocess
import sys

import pytest

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


def losses(out):
    return map(float, re.search(r"first loss ([0-9.]+)  last loss ([0-9.]+)", out).groups())


def accuracy_in(out):
    return float(re.search(r"test accuracy ([0-9.]+)", out).group(1))


def test_mirrored_strategy_trains_and_reloads_on_another_strategy():
    out = run_example("mirrored_strategy.py", "--smoke")
    assert "MirroredStrategy: 2 replicas" in out
    first, last = losses(out)
    assert last < first
    accuracy = accuracy_in(out)
    assert accuracy > 0.5  # chance is 0.1
    assert float(re.search(r"reloaded test accuracy ([0-9.]+)", out).group(1)) == accuracy


def test_custom_training_loop_equals_fit():
    out = run_example("custom_training_loop.py", "--smoke")
    difference = float(re.search(r"max weight difference, loop vs fit: ([0-9.e+-]+)",
                                 out).group(1))
    assert difference < 1e-5  # the uneven last batch (15 / 14) included
    assert accuracy_in(out) > 0.5


def test_data_pipeline_feeds_replicas():
    out = run_example("data_pipeline.py", "--smoke")
    assert "per-replica batch 32, global batch 64" in out
    first, last = losses(out)
    assert last < first
    assert accuracy_in(out) > 0.5


def test_lr_scaling_warms_up_to_the_scaled_rate():
    out = run_example("lr_scaling.py", "--smoke")
    rates = [float(r) for r in re.findall(r"learning rate ([0-9.]+)", out)]
    target = float(re.search(r"target rate ([0-9.]+)", out).group(1))
    assert target == pytest.approx(0.02 * 4)  # 4 replicas x batch 16 over 16
    assert rates[0] < rates[1] <= rates[2] == pytest.approx(target, rel=1e-4)
    assert accuracy_in(out) > 0.5


def test_mixed_precision_computes_in_bfloat16():
    out = run_example("mixed_precision.py", "--smoke")
    assert "policy mixed_bfloat16: variables float32, computation bfloat16" in out
    first, last = losses(out)
    assert last < first
    assert accuracy_in(out) > 0.5


def test_tpu_strategy_says_there_is_no_tpu_and_runs_anyway():
    out = run_example("tpu_strategy.py", "--smoke")
    assert "No TPU here" in out
    assert "MirroredStrategy: 2 replicas" in out
    assert accuracy_in(out) > 0.5


def test_multi_worker_example_on_two_launched_workers(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         os.path.join(EXAMPLES, "multi_worker.py"), "--smoke", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    accuracies = re.findall(r"\[worker \d\] test loss [0-9.]+  test accuracy ([0-9.]+)",
                            done.stdout)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert float(accuracies[0]) > 0.5
    assert "[worker 0] saved" in done.stdout and "[worker 1] saved" not in done.stdout
    assert sorted(os.listdir(tmp_path)) == ["digits.keras"]  # backups deleted at the end


def test_fault_tolerance_resumes_to_the_uninterrupted_weights():
    out = run_example("fault_tolerance.py", "--smoke")
    assert "exit code -9 (SIGKILL)" in out
    assert re.search(r"starting at optimizer step [1-9][0-9]* \(resumed from the backup\)", out)
    assert "finished at optimizer step 46" in out
    difference = float(re.search(r"resumed vs uninterrupted: ([0-9.e+-]+)", out).group(1))
    assert difference == 0.0


def test_profiling_writes_a_trace_and_reports_memory(tmp_path):
    out = run_example("profiling.py", "--smoke", "--log-dir", str(tmp_path))
    traces = [name for _, _, names in os.walk(tmp_path) for name in names
              if name.endswith(".xplane.pb")]
    assert traces
    assert re.search(r"profiler trace: [1-9]\d* file\(s\)", out)
    assert re.search(r"ResourceMonitor batch 10: .*memory/host_rss_mb [1-9]", out)
    assert float(re.search(r"host peak memory ([0-9.]+) MB", out).group(1)) > 10
    assert accuracy_in(out) > 0.3
