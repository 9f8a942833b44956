"""Tier 2: distributed keras-tuner searches through `keras-dist tune`."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multi_worker

SCRIPT = os.path.join(os.path.dirname(__file__), "search_main.py")


def tune(out, *options, args=(), timeout=300, script=SCRIPT):
    """Runs `keras-dist tune OPTIONS search_main.py OUT ARGS`; returns it."""
    return subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "tune", *options, script,
         str(out), *args],
        capture_output=True, text=True, timeout=timeout, env=_env(),
    )


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    return env


def runs(out):
    """{process label: [trial ids it started, in order]}."""
    found = {}
    for path in sorted(glob.glob(str(out / "runs-*.txt"))):
        label = os.path.basename(path)[len("runs-"):-len(".txt")]
        with open(path) as f:
            found[label] = f.read().split()
    return found


def summary(out, n=0):
    with open(out / f"summary-{n}.json") as f:
        return json.load(f)


def explain(job):
    return f"exit {job.returncode}\n--- stdout\n{job.stdout[-6000:]}\n--- stderr\n{job.stderr[-3000:]}"


def test_two_tuner_workers_run_every_trial_once(tmp_path):
    job = tune(tmp_path, "--num-workers", "2", args=["trials=6"])
    assert job.returncode == 0, explain(job)
    done = summary(tmp_path)
    assert done["trials"] == {str(i): "COMPLETED" for i in range(6)}
    started = runs(tmp_path)
    assert set(started) == {"tuner0-0", "tuner1-0"}
    assert sorted(started["tuner0-0"] + started["tuner1-0"]) == [str(i) for i in range(6)]
    # The best model was reloaded from the chief's directory and trained.
    assert done["best_loss"] < 5.0
    assert "search finished; oracle stopped" in job.stdout
    # keras_dist's tuners get the chief's per-trial progress lines too.
    trial_lines = sorted(line.split(":")[0] for line in job.stdout.splitlines()
                         if line.startswith("[chief] [keras-dist] trial "))
    # keras-tuner's numbering ("Trial 1" is trial id 00).
    assert trial_lines == sorted(
        f"[chief] [keras-dist] trial {i} completed" for i in range(1, 7)
    )


KERAS_TUNER_SCRIPT = os.path.join(os.path.dirname(__file__), "keras_tuner_main.py")


def test_a_plain_keras_tuner_script_runs_unchanged(tmp_path):
    # keras_tuner.RandomSearch(..., overwrite=True), as keras-tuner's docs
    # write it; the second run overwrites the first one's directory.
    for _ in range(2):
        job = tune(tmp_path, "--num-workers", "2", script=KERAS_TUNER_SCRIPT)
        assert job.returncode == 0, explain(job)
        trials = [line for line in job.stdout.splitlines()
                  if "[chief] [keras-dist] trial " in line]
        assert len(trials) == 3, explain(job)
        assert all("completed: val_accuracy" in line and "best so far: trial" in line
                   and "tuner workers running" in line for line in trials)
        # What the script prints after search() comes once, from the chief
        # (as from one plain process); the chief, which trains nothing,
        # shows no "Running Trial" tables.
        assert job.stdout.count("Results summary") == 1, explain(job)
        assert "[chief] Results summary" in job.stdout
        assert "Search: Running Trial" not in "".join(
            line for line in job.stdout.splitlines(True) if line.startswith("[chief]"))
        assert "search finished after" in job.stderr
        # TensorFlow's start-up lines stay out of the console.
        assert "cuInit" not in job.stdout and "absl::InitializeLog" not in job.stdout
    # The finished search run again with overwrite=False (as plain
    # keras-tuner resumes a project): nothing trains, the results print once.
    job = tune(tmp_path, "--num-workers", "2", script=KERAS_TUNER_SCRIPT,
               args=["resume"])
    assert job.returncode == 0, explain(job)
    assert "[keras-dist] trial " not in job.stdout, explain(job)
    assert "Search: Running Trial" not in job.stdout, explain(job)
    assert job.stdout.count("Results summary") == 1, explain(job)


def test_a_plain_tuner_in_trial_groups_stops_at_once_naming_the_fix(tmp_path):
    start = time.monotonic()
    job = tune(tmp_path, "--num-workers", "2", "--workers-per-trial", "2",
               script=KERAS_TUNER_SCRIPT)
    assert job.returncode == 1, explain(job)
    assert time.monotonic() - start < 120
    assert "replace `keras_tuner.RandomSearch` with `keras_dist.tuner.RandomSearch`" in job.stdout
    assert "every tuner worker has died" in job.stderr


def test_a_killed_worker_does_not_stall_the_search(tmp_path):
    # tuner1 kills itself (SIGKILL) when it starts its second trial; with
    # max_retries_per_trial=1 that trial is run again by tuner0.
    job = tune(tmp_path, "--num-workers", "2",
               args=["trials=6", "die=tuner1", "die_at=2", "retries=1", "sleep=0.5"])
    assert job.returncode == 0, explain(job)
    assert "tuner worker tuner1 was killed by SIGKILL" in job.stderr, explain(job)
    assert "1 tuner worker(s) died" in job.stderr
    assert "'tuner1' has been silent" in job.stdout, explain(job)
    done = summary(tmp_path)
    assert done["trials"] == {str(i): "COMPLETED" for i in range(6)}
    started = runs(tmp_path)
    lost = started["tuner1-0"][-1]
    assert started["tuner0-0"].count(lost) == 1
    assert sorted(started["tuner0-0"] + started["tuner1-0"]) == sorted(
        [str(i) for i in range(6)] + [lost])


def test_without_retries_the_dead_workers_trial_is_failed(tmp_path):
    job = tune(tmp_path, "--num-workers", "2",
               args=["trials=4", "die=tuner1", "die_at=1", "sleep=0.5"])
    assert job.returncode == 0, explain(job)
    statuses = summary(tmp_path)["trials"]
    lost = runs(tmp_path)["tuner1-0"][0]
    assert statuses.pop(lost) == "FAILED"
    assert set(statuses.values()) == {"COMPLETED"}


def test_a_trial_group_of_two_workers_runs_each_trial_together(tmp_path):
    job = tune(tmp_path, "--num-workers", "2", "--workers-per-trial", "2",
               args=["trials=3", "unseeded=1"])
    assert job.returncode == 0, explain(job)
    assert summary(tmp_path)["trials"] == {str(i): "COMPLETED" for i in range(3)}
    started = runs(tmp_path)
    assert started == {"tuner0-0": ["0", "1", "2"], "tuner0-1": ["0", "1", "2"]}
    # No seed anywhere: both members of the group end each trial identical.
    weights = [(tmp_path / f"weights-tuner0-{r}.txt").read_text().split("\n")
               for r in (0, 1)]
    assert weights[0] == weights[1] and len(weights[0]) == 4, weights


def test_a_restarted_chief_resumes_the_search(tmp_path):
    trials_dir = tmp_path / "search"
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "tune", "--num-workers", "2",
         SCRIPT, str(tmp_path), "trials=6", "sleep=1.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )
    deadline = time.monotonic() + 240
    completed = []
    while time.monotonic() < deadline and len(completed) < 2:
        completed = []
        for path in glob.glob(str(trials_dir / "trial_*" / "trial.json")):
            try:
                with open(path) as f:
                    trial = json.load(f)
            except (OSError, ValueError):
                continue  # being written
            if trial["status"] == "COMPLETED":
                completed.append(trial["trial_id"])
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # stops the chief and the workers
    first_output, _ = proc.communicate(timeout=60)
    assert len(completed) >= 2, first_output[-5000:]
    assert not (tmp_path / "summary-0.json").exists()
    first = runs(tmp_path)
    for path in glob.glob(str(tmp_path / "runs-*.txt")):
        os.remove(path)

    job = tune(tmp_path, "--num-workers", "2", args=["trials=6", "overwrite=0"])
    assert job.returncode == 0, explain(job)
    assert summary(tmp_path)["trials"] == {str(i): "COMPLETED" for i in range(6)}
    second = [t for ids in runs(tmp_path).values() for t in ids]
    # Trials completed before the restart are not run again; every other
    # trial (including those interrupted) runs once.
    assert not set(completed) & set(second)
    assert sorted(second + completed) == [str(i) for i in range(6)], (first, second)
