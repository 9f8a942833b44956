"""Tier 2: real MultiWorkerMirroredStrategy jobs, one subprocess per worker.

Most cases run in one shared 2-worker job (`worker_main.py cases`), one
after another in the same two processes, as a user's script runs several
fits; the single-device references run the same way in one process. Each
test reads its case's results. A 3-worker job and a failing job run alone.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from multi_worker._cluster import run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(__file__), "worker_main.py")
TOL = 1e-5

TRAIN = {
    "sgd": ["opt=sgd", "bn=0", "spe=1", "input=numpy", "val=1"],
    "adam-bn-spe4": ["opt=adam", "bn=1", "spe=4", "input=numpy"],
    "adam-bn-tfdata": ["opt=adam", "bn=1", "spe=1", "input=dataset"],
}
MIXED = {policy: ["opt=adam", "bn=1", "spe=1", "input=numpy", f"policy={policy}"]
         for policy in ("mixed_bfloat16", "mixed_float16")}
SOURCES = ["numpy", "dict", "dataset", "files"]
# Arrays under other global seeds (TensorFlow's, set on both workers before,
# gives Keras' own order): a different one per worker, or none.
SEEDINGS = ["per_worker", "none"]
LEAN = {"even": 64, "uneven": 69}


def single_device(out_dir, args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, WORKER, *args[:1], str(out_dir), *args[1:]],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


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


class Job:
    """The shared job's directories and outputs."""

    def __init__(self, root):
        self.root = root
        self.temp_dirs = [str(root / f"tmp{rank}") for rank in (0, 1)]
        self.outputs = None

    def mw(self, name):
        return self.root / "mw" / name

    def ref(self, name):
        return self.root / "ref" / name


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    job = Job(tmp_path_factory.mktemp("shared"))
    write_record_files(job.root / "records", 50, 4)
    worker_cases, reference_cases = [], []
    for name, options in [*TRAIN.items(), *MIXED.items()]:
        worker_cases.append(["train", str(job.mw(name)), *options])
        reference_cases.append(["train", str(job.ref(name)), *options])
    for source in SOURCES:
        # 50 samples, global batch 8: the last batch (2) is split over workers.
        args = ["n=50", "epochs=2", f"input={source}"]
        if source == "files":
            args.append(f"files={job.root / 'records'}")
        worker_cases.append(["coverage", str(job.mw(f"coverage-{source}")), *args])
    for seeding in SEEDINGS:
        worker_cases.append(["coverage", str(job.mw(f"coverage-numpy-{seeding}")), "n=50",
                             "epochs=2", "input=numpy", f"global_seed={seeding}"])
    for name, n in LEAN.items():
        worker_cases.append(["lean", str(job.mw(f"lean-{name}")), f"n={n}"])
        reference_cases.append(["lean", str(job.ref(f"lean-{name}")), f"n={n}"])
    # LearningRateScaler and PerReplicaMetrics; worker 1 is slow.
    worker_cases.append(["callbacks", str(job.mw("callbacks")), "slow=1"])
    for name, cases in (("worker", worker_cases), ("reference", reference_cases)):
        (job.root / f"{name}_cases.json").write_text(json.dumps(cases))
    job.outputs = run_workers(WORKER, ["cases", str(job.root / "worker_cases.json")],
                              temp_dirs=job.temp_dirs, timeout=900)
    single_device(job.root / "reference_cases.json", ["cases"])
    return job


@pytest.mark.parametrize("name", list(TRAIN))
def test_two_workers_match_one_device(job, name):
    options = TRAIN[name]
    outputs = job.outputs
    assert "MultiWorkerMirroredStrategy: 2 replicas, 2 workers (rank 0, chief)" in outputs[0]
    assert "(rank 1, not chief)" in outputs[1]
    ref = np.load(job.ref(name) / "rank0.npz")
    for rank in (0, 1):
        got = np.load(job.mw(name) / f"rank{rank}.npz")
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
    # other worker's scratch copy is gone (checked after every case ran).
    assert (job.mw(name) / "model.keras").exists()
    assert [os.listdir(d) for d in job.temp_dirs] == [[], []]


@pytest.mark.parametrize("policy", list(MIXED))
def test_two_workers_mixed_precision(job, policy):
    ref = np.load(job.ref(policy) / "rank0.npz")
    got = np.load(job.mw(policy) / "rank0.npz")
    assert got["loss"][1] < got["loss"][0]
    # Low-precision sums run in another order on 2 workers (measured:
    # 2.4e-5 for float16, 4.1e-4 for bfloat16).
    for key in (k for k in ref.files if k.startswith("w")):
        np.testing.assert_allclose(got[key], ref[key], atol=2e-3, err_msg=key)


@pytest.mark.parametrize("source", SOURCES + [f"numpy-{s}" for s in SEEDINGS])
def test_each_sample_once_per_epoch_across_workers(job, source):
    for rank in (0, 1):
        seen = np.load(job.mw(f"coverage-{source}") / f"rank{rank}.npz")["seen"]
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


@pytest.mark.parametrize("name", list(LEAN))
def test_one_iterator_per_epoch_and_no_data_check_when_batches_are_full(job, name):
    # Keras creates a spare iterator at every epoch end; keras_dist creates
    # the ones it uses (3 epochs: 3). Arrays whose every batch splits evenly
    # need no per-step "any data left?" all-reduce; a last batch of 69 % 16
    # = 5 samples does (a worker may get none).
    even = name == "even"
    ref = np.load(job.ref(f"lean-{name}") / "rank0.npz")
    for rank in (0, 1):
        got = np.load(job.mw(f"lean-{name}") / f"rank{rank}.npz")
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


def test_both_callbacks_on_two_workers(job):
    out = job.mw("callbacks")
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        # 2 replicas: the rate after the 4-step warmup is 2 x 0.01.
        np.testing.assert_allclose(got["learning_rate"], [0.02, 0.02], rtol=1e-6)
        np.testing.assert_array_equal(got["samples__replica_0"], [32.0, 32.0])
        np.testing.assert_array_equal(got["samples__replica_1"], [32.0, 32.0])
        # The global loss is the mean of the two workers' shard losses.
        np.testing.assert_allclose(
            got["loss"], (got["loss__replica_0"] + got["loss__replica_1"]) / 2,
            rtol=1e-5,
        )
        # Each worker's time is measured on its own clock (worker 1's epoch
        # begins 0.6 s after worker 0's, which waits for it meanwhile).
        assert (got["step_time__worker_0"] > 0).all(), got["step_time__worker_0"]
    # Worker 1 sleeps 150 ms after each step; worker 0 waits for it in the
    # barrier before the input, so only worker 1's step time carries it, and
    # the chief names it. (Over the run: on a loaded 2-core machine one
    # epoch's figures were once seen equal.)
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        slow, fast = got["step_time__worker_1"], got["step_time__worker_0"]
        assert slow.mean() > fast.mean() + 0.05, (slow, fast)
        assert slow.min() > 0.15
        np.testing.assert_allclose(
            got["step_time_ratio"], np.maximum(slow, fast) / np.minimum(slow, fast),
            rtol=1e-5)
    assert "worker 1 is a straggler" in job.outputs[0]
    assert "straggler" not in job.outputs[1]
    # Both workers ran the same collectives (the job finished) and the chief
    # wrote its CSV.
    assert (out / "replicas.csv").exists()
