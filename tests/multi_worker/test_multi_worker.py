"""Tier 2: real MultiWorkerMirroredStrategy jobs, one subprocess per worker."""

import os
import subprocess
import sys

import numpy as np
import pytest

from multi_worker._cluster import run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(__file__), "worker_main.py")
TOL = 1e-5


def single_device(out_dir, args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, WORKER, *args[:1], str(out_dir), *args[1:]],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return np.load(os.path.join(out_dir, "rank0.npz"))


@pytest.mark.parametrize(
    "options",
    [
        ["opt=sgd", "bn=0", "spe=1", "input=numpy", "val=1"],
        ["opt=adam", "bn=1", "spe=4", "input=numpy"],
        ["opt=adam", "bn=1", "spe=1", "input=dataset"],
    ],
    ids=["sgd", "adam-bn-spe4", "adam-bn-tfdata"],
)
def test_two_workers_match_one_device(tmp_path, options):
    temp_dirs = [str(tmp_path / f"tmp{rank}") for rank in (0, 1)]
    outputs = run_workers(
        WORKER, ["train", str(tmp_path / "mw"), *options], temp_dirs=temp_dirs
    )
    assert "MultiWorkerMirroredStrategy: 2 replicas, 2 workers (rank 0, chief)" in outputs[0]
    assert "(rank 1, not chief)" in outputs[1]
    ref = single_device(tmp_path / "ref", ["train", *options])
    for rank in (0, 1):
        got = np.load(tmp_path / "mw" / f"rank{rank}.npz")
        weights = sorted(k for k in ref.files if k.startswith("w"))
        assert len(weights) == (8 if "bn=1" in options else 4)
        for key in weights:
            np.testing.assert_allclose(got[key], ref[key], atol=TOL, err_msg=key)
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["eval"], ref["eval"], rtol=1e-5)
        np.testing.assert_allclose(got["pred"], ref["pred"], atol=TOL)
        if "val=1" in options:
            np.testing.assert_allclose(got["val_loss"], ref["val_loss"], rtol=1e-5)
    # Every worker called save(); only the chief's file was kept, and the
    # other worker's scratch copy is gone.
    assert (tmp_path / "mw" / "model.keras").exists()
    assert [os.listdir(d) for d in temp_dirs] == [[], []]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_two_workers_mixed_precision(tmp_path, policy):
    options = ["opt=adam", "bn=1", "spe=1", "input=numpy", f"policy={policy}"]
    run_workers(WORKER, ["train", str(tmp_path / "mw"), *options])
    ref = single_device(tmp_path / "ref", ["train", *options])
    got = np.load(tmp_path / "mw" / "rank0.npz")
    assert got["loss"][1] < got["loss"][0]
    # Low-precision sums run in another order on 2 workers (measured:
    # 2.4e-5 for float16, 4.1e-4 for bfloat16).
    for key in (k for k in ref.files if k.startswith("w")):
        np.testing.assert_allclose(got[key], ref[key], atol=2e-3, err_msg=key)


def write_record_files(directory, n, num_files):
    import tensorflow as tf

    os.makedirs(directory)
    for f in range(num_files):
        path = os.path.join(directory, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f, n, num_files):
                feature = tf.train.Feature(float_list=tf.train.FloatList(value=[i]))
                example = tf.train.Example(
                    features=tf.train.Features(feature={"id": feature})
                )
                writer.write(example.SerializeToString())


@pytest.mark.parametrize("source", ["numpy", "dict", "dataset", "files"])
def test_each_sample_once_per_epoch_across_workers(tmp_path, source):
    # 50 samples, global batch 8: the last batch (2) is split over workers.
    args = ["coverage", str(tmp_path), "n=50", "epochs=2", f"input={source}"]
    if source == "files":
        write_record_files(tmp_path / "records", 50, 4)
        args.append(f"files={tmp_path / 'records'}")
    run_workers(WORKER, args)
    for rank in (0, 1):
        seen = np.load(tmp_path / f"rank{rank}.npz")["seen"]
        np.testing.assert_array_equal(seen, np.ones((2, 50)))


def test_every_workers_vote_counts_in_an_agreement(tmp_path):
    # Preemption and other votes sum one value per worker; a worker other
    # than the chief must count too.
    run_workers(WORKER, ["agree", str(tmp_path)], num_workers=3)
    for rank in (0, 1, 2):
        assert list(np.load(tmp_path / f"rank{rank}.npz")["sum"]) == [6, 60]


def test_failing_worker_shows_every_output(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_workers(WORKER, ["no-such-scenario", str(tmp_path)], timeout=120)
    message = str(info.value)
    assert "worker 0" in message and "worker 1" in message
    assert "unknown scenario" in message


@pytest.mark.parametrize("n, even", [(64, True), (69, False)], ids=["even", "uneven"])
def test_one_iterator_per_epoch_and_no_data_check_when_batches_are_full(tmp_path, n, even):
    # Keras creates a spare iterator at every epoch end; keras_dist creates
    # the ones it uses (3 epochs: 3). Arrays whose every batch splits evenly
    # need no per-step "any data left?" all-reduce; a last batch of 69 % 16
    # = 5 samples does (a worker may get none).
    run_workers(WORKER, ["lean", str(tmp_path / "mw"), f"n={n}"])
    ref = single_device(tmp_path / "ref", ["lean", f"n={n}"])
    for rank in (0, 1):
        got = np.load(tmp_path / "mw" / f"rank{rank}.npz")
        assert got["checks"].tolist()[:3] == [not even] * 3
        # Released off the training thread, every one of them.
        assert got["released"].tolist() == [True, True, True]
        assert bool(got["same_strategy"])
        assert "already created its MultiWorkerMirroredStrategy with implementation=RING, " \
            "bytes_per_pack=0" in str(got["conflict"])
        assert "Received: implementation=AUTO, bytes_per_pack=1024" in str(got["conflict"])
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["mae"], ref["mae"], rtol=1e-5)
        for key in ("eval_mae", "eval_rms"):  # Keras' metric, a user's
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
        for key in sorted(k for k in ref.files if k.startswith("w")):
            np.testing.assert_allclose(got[key], ref[key], atol=TOL, err_msg=key)
