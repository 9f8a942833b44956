"""`keras-dist launch` driving real MultiWorkerMirroredStrategy jobs."""

import os
import time

import numpy as np
import pytest

import keras_dist
from multi_worker.test_multi_worker import WORKER, single_device

pytestmark = pytest.mark.multi_worker


@pytest.mark.parametrize("num_workers", [2, 3])
def test_launched_workers_match_one_process(tmp_path, capfd, num_workers):
    # 72 samples; global batch 12 splits evenly over 2 and 3 workers.
    options = ["opt=adam", "bn=1", "spe=1", "input=numpy", "batch=12"]
    status = keras_dist.launch(
        WORKER, ["train", str(tmp_path / "mw"), *options], num_workers=num_workers
    )
    out = capfd.readouterr().out
    assert status == 0, out
    assert (
        f"[worker {num_workers - 1}] MultiWorkerMirroredStrategy: {num_workers} "
        f"replicas, {num_workers} workers (rank {num_workers - 1}, not chief)"
    ) in out
    single_device(tmp_path / "ref", ["train", *options])
    ref = np.load(tmp_path / "ref" / "rank0.npz")
    for rank in range(num_workers):
        got = np.load(tmp_path / "mw" / f"rank{rank}.npz")
        for key in (k for k in ref.files if k.startswith("w")):
            np.testing.assert_allclose(got[key], ref[key], atol=1e-5, err_msg=key)


def test_killed_worker_stops_the_job_and_a_restart_finishes_it(tmp_path, capfd):
    options = ["opt=sgd", "bn=0", "spe=1", "input=numpy", "crash_rank=1"]
    out_dir = tmp_path / "mw"
    status = keras_dist.launch(
        WORKER, ["train", str(out_dir), *options], num_workers=2, grace_period=3
    )
    ended = time.time()
    err = capfd.readouterr().err
    assert status == 128 + 9
    assert "worker 1 was killed by SIGKILL; stopping the other workers" in err
    died = float((out_dir / "crashed").read_text())
    delay = ended - died
    print(f"death-to-exit delay: {delay:.2f}s")
    assert delay < 60  # stopped, not left hanging in a collective

    # The same job with one restart: the marker keeps it from dying again.
    os.remove(out_dir / "crashed")
    status = keras_dist.launch(
        WORKER, ["train", str(out_dir), *options], num_workers=2, max_restarts=1,
        grace_period=3,
    )
    err = capfd.readouterr().err
    assert status == 0, err
    assert "restarting the worker group (1/1) because worker 1 was killed by SIGKILL" in err
    assert (out_dir / "rank0.npz").exists() and (out_dir / "rank1.npz").exists()
