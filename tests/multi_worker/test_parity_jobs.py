"""Tier 2 parity: 2 unseeded MultiWorkerMirroredStrategy workers vs plain Keras.

Every case of tests/parity_cases.py runs on 2 worker processes with no seed
anywhere, models built with plain Keras before the first keras_dist call.
Each worker must end with the weights plain Keras reaches on one device
from the same initial weights (trained once, by worker 0: both start from
the chief's), and both workers with identical weights.
"""

import json
import os
from unittest import mock

import numpy as np
import pytest

from helpers import RequestCounter
from multi_worker._cluster import run_workers
from parity_cases import CASES, REFUSED_ON_WORKERS, compare

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(__file__), "parity_main.py")


def split(results: dict, name: str, kind: str) -> dict:
    prefix = f"{name}/{kind}/"
    return {k[len(prefix):]: results[k] for k in results if k.startswith(prefix)}


def run_and_compare(tmp_path, names, first=(), managed=False):
    with RequestCounter() as remote, mock.patch.dict(os.environ, {
        "PARITY_WORKDIR": str(tmp_path / "work"), "PARITY_REMOTE_MONITOR": remote.url,
    }):
        run_workers(WORKER, [str(tmp_path / "out"), *first, *names], timeout=560,
                    managed=managed)
    ranks = [dict(np.load(tmp_path / "out" / f"rank{r}.npz")) for r in (0, 1)]
    problems = []
    if "callbacks" in names:
        # Keras' file-writing callbacks: the job leaves what one process
        # leaves (compared file by file below, as `files`, `csv/*` and
        # `tensorboard/*`), and RemoteMonitor sends one request per epoch
        # from the chief, as the one plain process (worker 0's) does.
        epochs = len(split(ranks[0], "callbacks", "plain")["history/loss"])
        assert remote.by_run() == {"keras_dist": [epochs], "plain": [epochs]}
    for name in names:
        if name in REFUSED_ON_WORKERS:
            for rank, results in enumerate(ranks):
                refused = str(results.get(f"{name}/refused", "not refused"))
                if REFUSED_ON_WORKERS[name] not in refused:
                    problems.append(f"{name} (worker {rank}): {refused}")
            continue
        for rank, results in enumerate(ranks):
            distributed = split(results, name, "keras_dist")
            plain = split(ranks[0], name, "plain")
            problems += [f"{name} (worker {rank}): {p}" for p in compare(distributed, plain)]
        weights = [
            [v for k, v in sorted(split(r, name, "keras_dist").items())
             if k.startswith("weights/")]
            for r in ranks
        ]
        assert weights[0], name
        for a, b in zip(*weights):
            if not np.array_equal(a, b):
                problems.append(f"{name}: workers ended with different weights")
                break
    return problems


def test_two_unseeded_workers_match_plain_keras(tmp_path):
    names = sorted(CASES)
    # The first case makes its input pipeline, data-adapted layer, variables
    # and layers before keras_dist creates the strategy (the order of the
    # tutorials); the second builds layers before `DistributedModel(...)`.
    for first in ("functional_form", "made_before_the_model"):
        names.remove(first)
        names.insert(0, first)
    problems = run_and_compare(tmp_path, names)
    assert not problems, "\n".join(problems)


def test_models_built_after_the_strategy_start_identical(tmp_path):
    """The strategy first, then unseeded models converted: same start everywhere.

    In the `TF_CONFIG` shape of a managed job (Vertex AI, SageMaker,
    Kubeflow's TFJob): a chief, a worker and an evaluator running the same
    script. The chief (rank 0) and the worker (rank 1) train together; the
    evaluator stays outside their cluster, evaluates, and is refused a fit.
    """
    problems = run_and_compare(
        tmp_path, ["functional_form", "numpy", "subclassed"], first=["--strategy-first"],
        managed=True,
    )
    assert not problems, "\n".join(problems)
    evaluator = json.loads((tmp_path / "out" / "evaluator.json").read_text())
    assert evaluator["info"] == [2, -1, False, "evaluator"]
    assert "MultiWorker" not in evaluator["strategy"], evaluator["strategy"]
    assert evaluator["evaluated"] >= 0
    assert evaluator["refused"].startswith(
        "fit(): this process is the job's evaluator task (TF_CONFIG task "
        "{'type': 'evaluator', 'index': 0}), which trains nothing: the chief and "
        "the 1 other worker(s) train."), evaluator["refused"]


IMPORTED_LAST = """
import numpy as np, tensorflow as tf, keras
x = np.linspace(-1, 1, 64 * 4, dtype="float32").reshape(64, 4)
dataset = tf.data.Dataset.from_tensor_slices((x, x.sum(1))).batch(16)
import keras_dist
model = keras_dist.distribute(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
print("TRAINING STARTED", flush=True)
model.compile("sgd", "mse")
model.fit(dataset, epochs=1, verbose=0)
"""


def test_keras_dist_imported_after_tensorflow_started_fails_before_any_work(tmp_path):
    """The one script order that cannot train: TensorFlow's runtime ran before
    keras_dist could make it start as a task of the job. Each worker stops at
    its first keras_dist call with the fix, before any step."""
    import subprocess
    import sys

    job = tmp_path / "imported_last.py"
    job.write_text(IMPORTED_LAST)
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", str(job)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "TRAINING STARTED" not in out
    assert "Put `import keras_dist` before the first TensorFlow or Keras call" in out, out[-3000:]
