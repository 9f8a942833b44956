"""Interrupted jobs lose nothing.

- Preemption of any rank: the job saves once, every rank exits 42, and the
  resumed job ends at the uninterrupted run's weights with every sample
  trained exactly once per epoch.
- SIGKILL inside a backup save, at each stage of writing it: the same.
- Ctrl-C on the launcher: the workers save within two steps and exit, the
  console ends with where to resume, and the rerun is the uninterrupted
  run; Ctrl-C twice stops everything at once.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from keras_dist.callbacks.backup_and_restore import PREEMPTED_EXIT_CODE
from multi_worker._cluster import run_workers
from multi_worker.test_backup_jobs import (
    EPOCHS,
    SCRIPT,
    check_each_sample_once,
    max_diff,
    run_single,
    surviving_steps,
    uninterrupted,
    weights,
)

pytestmark = pytest.mark.multi_worker


def launch(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         SCRIPT, *map(str, args)],
        env=env, capture_output=True, text=True, timeout=400,
    )
    return done.returncode, done.stdout + done.stderr


def rank0(launcher_output: str) -> str:
    return "\n".join(
        line[len("[worker 0] "):] for line in launcher_output.splitlines()
        if line.startswith("[worker 0] ")
    )


def test_preempting_either_rank_saves_once_and_resumes_exactly(tmp_path):
    job, backup = tmp_path / "job", tmp_path / "backup"
    code, out = run_single(tmp_path / "ref", tmp_path / "ref-backup", "freq=2")
    assert code == 0, out
    # SIGTERM to worker 1 (not the chief) after its 5th step: its request
    # reaches the chief, and both save once, after the step that follows
    # the request (6: the first one neither worker had begun when it asked).
    codes, out1 = run_workers(
        SCRIPT, [str(job), str(backup), "freq=2", "term=5", "victim=1"], check=False)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, out1
    assert out1[0].count("preemption signal received; backup saved at epoch 1, step 6") == 1
    assert "preemption signal received" not in out1[1]  # the chief reports it
    # Under the launcher, SIGTERM to worker 0: the launcher exits 42 and says why.
    code, out2 = launch(job, backup, "freq=2", "term=5", "victim=0")
    assert code == PREEMPTED_EXIT_CODE, out2
    assert "exited with code 42 (preempted: it saved a backup)" in out2
    assert "restored" in out2 and "(epoch 1, step 6)" in out2
    assert rank0(out2).count("preemption signal received") == 1
    # The resumed job finishes at the uninterrupted run's weights.
    code, out3 = launch(job, backup, "freq=2")
    assert code == 0, out3
    reference = weights(tmp_path / "ref" / "rank0.npz")
    for rank in (0, 1):
        assert max_diff(reference, weights(job / f"rank{rank}.npz")) < 1e-6
    kept, runs = surviving_steps(
        job / "ids-rank0.txt", [out1[0], rank0(out2), rank0(out3)]
    )
    assert len(runs) == 3
    check_each_sample_once(kept, EPOCHS)
    assert not os.path.exists(backup)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    code, text = run_single(out / "job", out / "backup", "freq=2")
    assert code == 0, text
    return weights(out / "job" / "rank0.npz")


@pytest.mark.parametrize("stage", ["files", "rename", "pointer"])
def test_a_kill_inside_a_save_loses_nothing(tmp_path, reference, stage):
    job, backup = tmp_path / "job", tmp_path / "backup"
    # The 4th save (after step 8, in epoch 2) is cut short.
    code, killed = run_single(job, backup, "freq=2", f"killsave=4:{stage}")
    assert code == -9, killed
    code, resumed = run_single(job, backup, "freq=2")
    assert code == 0, resumed
    # Cut before its rename, the 4th backup never existed: the 3rd (after
    # global step 6, the end of epoch 1) is used. Renamed, the 4th is
    # complete (`latest` is not what chooses): epoch 2, step 2.
    at = "(epoch 1, step 6)" if stage != "pointer" else "(epoch 2, step 2)"
    assert "BackupAndRestore: restored" in resumed and at in resumed, resumed
    assert max_diff(reference, weights(job / "rank0.npz")) < 1e-6
    kept, runs = surviving_steps(job / "ids-rank0.txt", [killed, resumed])
    assert len(runs) == 2
    check_each_sample_once(kept, EPOCHS)
    assert not os.path.exists(backup)


def start_paced(job, backup, sleep, freq="epoch", steps=2):
    """A launched 2-worker job whose steps are paced (`sleep` s after each),
    once both workers have trained `steps` steps."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         SCRIPT, str(job), str(backup), f"freq={freq}", f"sleep={sleep}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        trained = [sum(1 for line in open(f) if not line.startswith("start"))
                   if f.exists() else 0 for f in (job / "ids-rank0.txt", job / "ids-rank1.txt")]
        if min(trained) >= steps:
            return proc
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the job never trained 2 steps:\n{proc.communicate()[0]}")


def job_processes(job) -> list[int]:
    """Processes still running with the job's directory on their command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(job).encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_ctrl_c_saves_and_the_rerun_resumes_exactly(tmp_path):
    job, backup = tmp_path / "job", tmp_path / "backup"
    job.mkdir()
    proc = start_paced(job, backup, sleep=0.5)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the terminal signals the launcher
    out1, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out1
    launcher = [line for line in out1.splitlines() if line.startswith("[keras-dist] ")]
    assert launcher[-2].startswith(
        "[keras-dist] received Ctrl-C: asking the workers to save a backup within two "
        "steps and exit (up to 60s; Ctrl-C again stops them at once)"), out1
    assert launcher[-1].startswith(
        f"[keras-dist] interrupted: the workers saved a backup in {backup} at epoch 1, "
        "step "), out1
    assert launcher[-1].endswith("; run the same command again to resume from there"), out1
    assert "Traceback" not in out1 and "KeyboardInterrupt" not in out1, out1
    saved_step = int(launcher[-1].split("step ")[1].split(";")[0])
    assert f"backup saved at epoch 1, step {saved_step}." in out1
    # The same command again: resumes after the last trained step, and ends
    # at the uninterrupted run's weights, each sample trained once per epoch.
    (job / "unpaced").touch()
    code, out2 = launch(job, backup, "freq=epoch")
    assert code == 0, out2
    assert f"restored {backup}" in out2 and f"(epoch 1, step {saved_step})" in out2, out2
    reference = uninterrupted(tmp_path, "freq=epoch")
    for rank in (0, 1):
        assert max_diff(reference, weights(job / f"rank{rank}.npz")) < 1e-6
    kept, runs = surviving_steps(job / "ids-rank0.txt", [rank0(out1), rank0(out2)])
    assert len(runs) == 2 and len(runs[0]) == saved_step  # no step trained twice
    check_each_sample_once(kept, EPOCHS)


def test_ctrl_c_twice_stops_everything_at_once(tmp_path):
    job, backup = tmp_path / "job", tmp_path / "backup"
    job.mkdir()
    # Each step is followed by 30 s: the save asked by the first Ctrl-C
    # would wait for the next step; the second stops the job at once.
    proc = start_paced(job, backup, sleep=30)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    stopped_after = time.monotonic() - second
    assert proc.returncode == 128 + signal.SIGINT, out
    assert stopped_after < 2, (stopped_after, out)
    assert out.rstrip().splitlines()[-1] == (
        "[keras-dist] interrupted: Ctrl-C twice, the workers were stopped at once, "
        "without a save; run the same command again to resume from the last backup "
        "saved before, if any"), out
    assert job_processes(job) == []


def test_after_the_launcher_is_killed_the_rerun_resumes_exactly(tmp_path):
    # SIGKILL of the launcher (the OOM killer, a lost login shell) mid-epoch
    # 2: its workers end with it, and the same command again resumes from
    # the last backup to the uninterrupted run's weights (also after a
    # second job was pointed at its backups while it trained).
    job, backup = tmp_path / "job", tmp_path / "backup"
    job.mkdir()
    proc = start_paced(job, backup, sleep=0.3, freq=2, steps=9)
    # A second job on the live job's backup directory (a re-run started
    # too early): refused on both its workers before any step, naming the
    # live run's chief; the live job's backups are left to it.
    try:
        (job / "held").touch()  # the live job waits after its next step
        second = tmp_path / "second"
        second.mkdir()
        code, refused = launch(second, backup, "freq=2")
        assert code != 0, refused
        refusal = "ValueError: Invalid value for argument `backup_dir`: another run is using it."
        assert refused.count(refusal) >= 2, refused  # each worker's (the second may be shortened)
        assert f"{refusal} Received: backup_dir='{backup}', in use by pid " in refused, refused
        assert not (second / "ids-rank0.txt").exists() or all(
            line.startswith("start") for line in open(second / "ids-rank0.txt")), refused
        assert proc.poll() is None  # the live job was not disturbed
    finally:  # the live job ends here, as it would at a SIGKILL of its launcher
        (job / "held").unlink(missing_ok=True)
        proc.kill()
    out1, _ = proc.communicate(timeout=30)
    deadline = time.monotonic() + 5
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == []  # no worker trains on, writing backups
    (job / "unpaced").touch()
    code, out2 = launch(job, backup, "freq=2")
    assert code == 0, out2
    assert f"restored {backup}" in out2, out2
    reference = uninterrupted(tmp_path, "freq=2")
    for rank in (0, 1):
        assert max_diff(reference, weights(job / f"rank{rank}.npz")) < 1e-6
    kept, runs = surviving_steps(job / "ids-rank0.txt", [rank0(out1), rank0(out2)])
    assert len(runs) == 2
    check_each_sample_once(kept, EPOCHS)
