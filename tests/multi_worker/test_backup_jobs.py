"""Tier 2: kill real training processes and resume them from their backups."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from keras_dist.callbacks.backup_and_restore import PREEMPTED_EXIT_CODE
from multi_worker._cluster import run_workers

pytestmark = pytest.mark.multi_worker

SCRIPT = os.path.join(os.path.dirname(__file__), "backup_main.py")
STEPS_PER_EPOCH = 6  # 48 samples, global batch 8
EPOCHS = 3


def run_single(out_dir, backup_dir, *options):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, SCRIPT, str(out_dir), str(backup_dir), *options],
        env=env, capture_output=True, text=True, timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


_REFERENCES = {}  # training options (backup frequency left out) -> weights


def uninterrupted(tmp_path, *options):
    """The weights of an uninterrupted one-process run (2 replicas) with
    these options; how often backups are saved changes no weight, so runs
    that differ only in it share one."""
    key = tuple(sorted(o for o in options if not o.startswith("freq=")))
    if key not in _REFERENCES:
        code, out = run_single(tmp_path / "ref", tmp_path / "ref-backup", *options)
        assert code == 0, out
        _REFERENCES[key] = weights(tmp_path / "ref" / "rank0.npz")
    return _REFERENCES[key]


def weights(path):
    data = np.load(path)
    return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def surviving_steps(ids_file, outputs_in_order):
    """The steps whose effect survived: per run, those before the next resume point."""
    runs = []
    with open(ids_file) as f:
        for line in f:
            if line.startswith("start"):
                runs.append([])
                continue
            parts = line.split()
            runs[-1].append(((int(parts[0]), int(parts[1])), [int(i) for i in parts[2:]]))
    resume_points = []
    for output in outputs_in_order[1:]:
        line = [x for x in output.splitlines() if "BackupAndRestore: restored" in x][0]
        epoch = int(line.split("(epoch ")[1].split(",")[0]) - 1
        step = int(line.split("step ")[1].rstrip(")"))
        resume_points.append((epoch, step))
    kept = []
    for index, run in enumerate(runs):
        limit = resume_points[index] if index < len(resume_points) else None
        kept += [ids for (e, s), ids in run if limit is None or (e, s) < limit]
    return kept, runs


def check_each_sample_once(kept, epochs, n=48):
    per_epoch = len(kept) // epochs
    for epoch in range(epochs):
        seen = sorted(i for ids in kept[epoch * per_epoch:(epoch + 1) * per_epoch] for i in ids)
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"


def test_sigkill_twice_then_resume_matches_uninterrupted(tmp_path):
    """SIGKILL mid-epoch 2, then again in the resumed epoch (seeded random steps)."""
    source = "numpy"
    rng = random.Random(source)
    first = rng.randrange(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH)  # mid epoch 2
    second = rng.randrange(2, STEPS_PER_EPOCH)  # within the resumed epoch
    opts = [f"input={source}", "freq=2"]
    reference = uninterrupted(tmp_path, *opts)
    outputs = []
    for kill in (first, second, None):
        extra = [f"kill={kill}"] if kill else []
        code, out = run_single(tmp_path / "job", tmp_path / "backup", *opts, *extra)
        outputs.append(out)
        assert code == (-9 if kill else 0), out
    resumed = weights(tmp_path / "job" / "rank0.npz")
    assert max_diff(reference, resumed) < 1e-6
    kept, runs = surviving_steps(tmp_path / "job" / "ids-rank0.txt", outputs)
    assert len(runs) == 3
    assert len(kept) == EPOCHS * STEPS_PER_EPOCH
    check_each_sample_once(kept, EPOCHS)
    assert not os.path.exists(tmp_path / "backup")  # deleted at the end


def test_two_workers_sigkill_and_sigterm_then_resume(tmp_path):
    """Worker 1 is killed mid-epoch; later worker 0 is preempted (SIGTERM)."""
    reference = uninterrupted(tmp_path, "input=numpy", "freq=2")
    temp = [str(tmp_path / f"tmp{r}") for r in (0, 1)]
    codes, out1 = run_workers(
        SCRIPT, [str(tmp_path / "job"), str(tmp_path / "backup"), "freq=2",
                 "kill=9", "victim=1"], temp_dirs=temp, check=False)
    assert codes[1] == -9, out1
    # SIGTERM at the resumed run's last step (10 of the 18 trained from
    # epoch 2, step 2): past every batch's agreement, the end of training
    # saves and exits 42, and the rerun trains nothing more.
    codes, out2 = run_workers(
        SCRIPT, [str(tmp_path / "job"), str(tmp_path / "backup"), "freq=2",
                 "term=10", "victim=0"], temp_dirs=temp, check=False)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, out2
    assert "restored" in out2[0] and "(epoch 2, step 2)" in out2[0]
    assert "backup saved at the end of training (epoch 3)" in out2[0], out2[0]
    out3 = run_workers(
        SCRIPT, [str(tmp_path / "job"), str(tmp_path / "backup"), "freq=2"],
        temp_dirs=temp)
    assert "restored" in out3[0] and "(epoch 4, step 0)" in out3[0], out3[0]
    for rank in (0, 1):
        assert max_diff(reference, weights(tmp_path / "job" / f"rank{rank}.npz")) < 1e-6
    # Only the chief's files persisted; the other worker's scratch is empty.
    assert not os.listdir(temp[1]) or all(
        not name.startswith("keras_dist_backup_") for name in os.listdir(temp[1])
    )
    kept, _ = surviving_steps(
        tmp_path / "job" / "ids-rank0.txt", [out1[0], out2[0], out3[0]]
    )
    check_each_sample_once(kept, EPOCHS)
    assert not os.path.exists(tmp_path / "backup")


@pytest.mark.parametrize("source", ["numpy", "dataset"])
def test_resumes_on_another_number_of_workers(tmp_path, source):
    """2 workers -> killed -> 1 process -> killed -> 3 workers, global batch
    12, Adam, BatchNormalization, Dropout, no seed but the model's: the
    weights of an uninterrupted 2-worker run, each sample once per epoch."""
    opts = [f"input={source}", "batch=12", "freq=1", "bn=1"]
    reference = uninterrupted(tmp_path, *opts)
    codes, first = run_workers(SCRIPT, [str(tmp_path / "job"), str(tmp_path / "backup"),
                                        *opts, "kill=5", "victim=1"],
                               check=False)
    assert codes[1] == -9, first
    code, second = run_single(tmp_path / "job", tmp_path / "backup", *opts, "replicas=1",
                              "kill=3")
    assert code == -9, second
    assert "restored" in second
    third = run_workers(SCRIPT, [str(tmp_path / "job"), str(tmp_path / "backup"), *opts],
                        num_workers=3)
    assert "restored" in third[0]
    for rank in range(3):
        assert max_diff(reference, weights(tmp_path / "job" / f"rank{rank}.npz")) < 1e-5
    kept, runs = surviving_steps(tmp_path / "job" / "ids-rank0.txt",
                                 [first[0], second, third[0]])
    assert len(runs) == 3
    assert len(kept) == EPOCHS * 4  # 48 samples, global batch 12
    check_each_sample_once(kept, EPOCHS)


def test_timed_saves_are_agreed_without_a_collective_per_step(tmp_path):
    """2 workers save every 0.1 s of paced steps (the chief's clock); worker
    1 is killed mid-epoch 3: the saves were agreed without a collective per
    step, and the resume from the newest one ends at the uninterrupted
    weights, each sample once per epoch."""
    opts = ["freq=epoch", "seconds=0.1", "sleep=0.05"]
    reference = uninterrupted(tmp_path, "input=numpy", "freq=2")
    job, backup = str(tmp_path / "job"), str(tmp_path / "backup")
    codes, out1 = run_workers(SCRIPT, [job, backup, *opts, "kill=14", "victim=1"],
                              check=False)
    assert codes[1] == -9, out1
    with open(tmp_path / "job" / "events-rank0.txt") as f:
        events = [(kind, int(k)) for kind, k in map(str.split, f)]
    saves = [k for kind, k in events if kind == "save"]
    agreed = [k for kind, k in events if kind == "agree"]
    assert len([k for k in saves if k % STEPS_PER_EPOCH]) >= 2, events  # the clock's
    # Choosing the backup (4), one per epoch begun (did a later callback
    # change?), one per timed save: none per step.
    assert len(agreed) <= 4 + EPOCHS + len(saves) and len(agreed) < max(agreed), events
    out2 = run_workers(SCRIPT, [job, backup, *opts])
    assert "restored" in out2[0], out2[0]
    for rank in (0, 1):
        assert max_diff(reference, weights(tmp_path / "job" / f"rank{rank}.npz")) < 1e-6
    kept, runs = surviving_steps(tmp_path / "job" / "ids-rank0.txt", [out1[0], out2[0]])
    assert len(runs) == 2
    check_each_sample_once(kept, EPOCHS)
    assert not os.path.exists(backup)
