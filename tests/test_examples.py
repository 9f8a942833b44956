"""Runs every example in its smoke mode and checks what it reports.

The smoke runs start together, two at a time, in a module fixture (their
outcomes are checked, never their speed); each test reads its run's output.
"""

import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from helpers import run_concurrently
from multi_worker._cluster import workers_of

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(EXAMPLES, name), *args]


def launched(verb: str, name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "keras_dist.cli", verb, "--num-workers", "2",
            os.path.join(EXAMPLES, name), *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = {name: str(tmp_path_factory.mktemp(name)) for name in
         ("tuner_alone", "tuner_tune", "multi_worker", "profiling")}
    # The multi-process runs first: they take longest.
    commands = {
        "fault_tolerance": script("fault_tolerance.py", "--smoke"),
        "tuner_tune": launched("tune", "tuner_search.py", "--smoke",
                               "--directory", d["tuner_tune"]),
        "quickstart_launch": launched("launch", "quickstart.py", "--smoke"),
        "multi_worker": launched("launch", "multi_worker.py", "--smoke",
                                 "--out-dir", d["multi_worker"]),
        "quickstart": script("quickstart.py", "--smoke"),
        "tuner_alone": script("tuner_search.py", "--smoke", "--directory", d["tuner_alone"]),
        "model_parallel": script("model_parallel.py", "--smoke"),
        "mirrored_strategy": script("mirrored_strategy.py", "--smoke"),
        "custom_training_loop": script("custom_training_loop.py", "--smoke"),
        "data_pipeline": script("data_pipeline.py", "--smoke"),
        "lr_scaling": script("lr_scaling.py", "--smoke"),
        "mixed_precision": script("mixed_precision.py", "--smoke"),
        "tpu_strategy": script("tpu_strategy.py", "--smoke"),
        "profiling": script("profiling.py", "--smoke", "--log-dir", d["profiling"]),
    }
    return run_concurrently(commands, timeout=300), d


def output(runs, name: str) -> str:
    done = runs[0][name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_quickstart_learns_digits_on_two_replicas(runs):
    out = output(runs, "quickstart")
    assert "MirroredStrategy: 2 replicas, 1 worker (rank 0, chief)" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.5  # chance is 0.1 on 10 classes


def test_quickstart_on_two_launched_workers(runs):
    out = output(runs, "quickstart_launch")
    for rank in (0, 1):
        assert (
            f"[worker {rank}] MultiWorkerMirroredStrategy: 2 replicas, 2 workers "
            f"(rank {rank}" in out
        )
    accuracies = re.findall(r"\[worker \d\] test loss [0-9.]+  test accuracy ([0-9.]+)",
                            out)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert float(accuracies[0]) > 0.5


def test_tuner_search_alone_on_two_replicas(runs):
    out = output(runs, "tuner_alone")
    assert "2 trials completed" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.3  # chance is 0.1; one epoch of the best of 2 trials


def test_tuner_search_with_two_tuner_workers(runs):
    out = output(runs, "tuner_tune")
    assert "[chief] 2 trials completed" in out
    accuracy = float(re.search(r"\[chief\] best model: test accuracy ([0-9.]+)",
                               out).group(1))
    assert accuracy > 0.3


def test_model_parallel_trains_sharded_on_four_logical_cpus(runs):
    out = output(runs, "model_parallel")
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


def test_mirrored_strategy_trains_and_reloads_on_another_strategy(runs):
    out = output(runs, "mirrored_strategy")
    assert "MirroredStrategy: 2 replicas" in out
    first, last = losses(out)
    assert last < first
    accuracy = accuracy_in(out)
    assert accuracy > 0.5  # chance is 0.1
    assert float(re.search(r"reloaded test accuracy ([0-9.]+)", out).group(1)) == accuracy


def test_custom_training_loop_equals_fit(runs):
    out = output(runs, "custom_training_loop")
    difference = float(re.search(r"max weight difference, loop vs fit: ([0-9.e+-]+)",
                                 out).group(1))
    assert difference < 1e-5  # the uneven last batch (15 / 14) included
    assert accuracy_in(out) > 0.5


def test_data_pipeline_feeds_replicas(runs):
    out = output(runs, "data_pipeline")
    assert "per-replica batch 32, global batch 64" in out
    first, last = losses(out)
    assert last < first
    assert accuracy_in(out) > 0.5


def test_lr_scaling_warms_up_to_the_scaled_rate(runs):
    out = output(runs, "lr_scaling")
    rates = [float(r) for r in re.findall(r"learning rate ([0-9.]+)", out)]
    target = float(re.search(r"target rate ([0-9.]+)", out).group(1))
    assert target == pytest.approx(0.02 * 4)  # 4 replicas x batch 16 over 16
    assert rates[0] < rates[1] <= rates[2] == pytest.approx(target, rel=1e-4)
    assert accuracy_in(out) > 0.5


def test_mixed_precision_computes_in_bfloat16(runs):
    out = output(runs, "mixed_precision")
    assert "policy mixed_bfloat16: variables float32, computation bfloat16" in out
    first, last = losses(out)
    assert last < first
    assert accuracy_in(out) > 0.5


def test_tpu_strategy_says_there_is_no_tpu_and_runs_anyway(runs):
    out = output(runs, "tpu_strategy")
    assert "No TPU here" in out
    assert "MirroredStrategy: 2 replicas" in out
    assert accuracy_in(out) > 0.5


def test_multi_worker_example_on_two_launched_workers(runs):
    out = output(runs, "multi_worker")
    accuracies = re.findall(r"\[worker \d\] test loss [0-9.]+  test accuracy ([0-9.]+)",
                            out)
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert float(accuracies[0]) > 0.5
    assert "[worker 0] saved" in out and "[worker 1] saved" not in out
    # The backups are deleted at the end; only the chief's model file stays.
    assert sorted(os.listdir(runs[1]["multi_worker"])) == ["digits.keras"]


def test_fault_tolerance_resumes_to_the_uninterrupted_weights(runs):
    out = output(runs, "fault_tolerance")
    assert "exit code -9 (SIGKILL)" in out
    assert re.search(r"starting at optimizer step [1-9][0-9]* \(resumed from the backup\)", out)
    assert "finished at optimizer step 46" in out
    difference = float(re.search(r"resumed vs uninterrupted: ([0-9.e+-]+)", out).group(1))
    assert difference == 0.0


def test_profiling_writes_a_trace_and_reports_memory(runs):
    out = output(runs, "profiling")
    tmp_path = runs[1]["profiling"]
    traces = [name for _, _, names in os.walk(tmp_path) for name in names
              if name.endswith(".xplane.pb")]
    assert traces
    assert re.search(r"profiler trace: [1-9]\d* file\(s\)", out)
    assert re.search(r"ResourceMonitor batch 10: .*memory/host_rss_mb [1-9]", out)
    assert float(re.search(r"host peak memory ([0-9.]+) MB", out).group(1)) > 10
    assert accuracy_in(out) > 0.3


@pytest.mark.multi_worker
def test_multi_worker_example_killed_mid_run_resumes_under_max_restarts(tmp_path):
    # As its guide says: no --out-dir (every worker uses ./multi_worker_out).
    job = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         "--max-restarts", "1", os.path.join(EXAMPLES, "multi_worker.py"),
         "--epochs", "5"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""),
    )
    timer = threading.Timer(480, job.kill)
    timer.start()
    lines, killed = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if killed is None and line.startswith("[worker 0] Epoch 3/5"):
                # Epochs 1 and 2 are backed up: kill worker 1 in epoch 3.
                killed = sorted(workers_of(job.pid))[-1]
                os.kill(killed, signal.SIGKILL)
        job.wait()
    finally:
        timer.cancel()
    out = "".join(lines)
    assert killed is not None and job.returncode == 0, out[-4000:]
    assert "restarting the worker group (1/1) because worker" in out, out[-4000:]
    assert "job finished: 2 worker(s) exited with code 0" in out
    first, second = out.split("restarting the worker group")
    # The restarted group resumed at epoch 3: epochs 1-2 never ran again.
    assert "[worker 0] Epoch 1/5" in first and "Epoch 1/5" not in second
    assert "Epoch 2/5" not in second and "[worker 0] Epoch 3/5" in second
    assert "[worker 0] Epoch 5/5" in second
    assert os.path.exists(tmp_path / "multi_worker_out" / "digits.keras")
