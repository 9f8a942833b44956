"""Interrupted jobs lose nothing.

- Preemption of any rank: the job saves once, every rank exits 42, and the
  resumed job ends at the uninterrupted run's weights with every sample
  trained exactly once per epoch.
- SIGKILL inside a backup save, at each stage of writing it: the same.
"""

import os
import subprocess
import sys

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
    # SIGTERM to worker 1 (not the chief): the vote counts it, both save once.
    codes, out1 = run_workers(
        SCRIPT, [str(job), str(backup), "freq=2", "term=5", "victim=1"], check=False)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, out1
    assert out1[0].count("preemption signal received; backup saved at epoch 1, step 5") == 1
    assert "preemption signal received" not in out1[1]  # the chief reports it
    # Under the launcher, SIGTERM to worker 0: the launcher exits 42 and says why.
    code, out2 = launch(job, backup, "freq=2", "term=5", "victim=0")
    assert code == PREEMPTED_EXIT_CODE, out2
    assert "exited with code 42 (preempted: it saved a backup)" in out2
    assert "restored" in out2 and "(epoch 1, step 5)" in out2
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
