"""Tier 2 parity: 2 unseeded MultiWorkerMirroredStrategy workers vs plain Keras.

Every case of tests/parity_cases.py runs on 2 worker processes with no seed
anywhere, models built with plain Keras before the first keras_dist call.
Each worker must end with the weights plain Keras reaches on one device
from the same initial weights, and both workers with identical weights.
"""

import os
from unittest import mock

import numpy as np
import pytest

from multi_worker._cluster import run_workers
from parity_cases import CASES, LOSS_SCALED_IN_LOGS, compare

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(__file__), "parity_main.py")


def split(results: dict, name: str, kind: str) -> dict:
    prefix = f"{name}/{kind}/"
    return {k[len(prefix):]: results[k] for k in results if k.startswith(prefix)}


def run_and_compare(tmp_path, names, first=()):
    with mock.patch.dict(os.environ, {"PARITY_WORKDIR": str(tmp_path / "work")}):
        run_workers(WORKER, [str(tmp_path / "out"), *first, *names], timeout=560)
    ranks = [dict(np.load(tmp_path / "out" / f"rank{r}.npz")) for r in (0, 1)]
    problems = []
    for name in names:
        for rank, results in enumerate(ranks):
            distributed = split(results, name, "keras_dist")
            plain = split(results, name, "plain")
            if name in LOSS_SCALED_IN_LOGS:
                # 2 replicas: Keras' distribution-scaled loss is half.
                np.testing.assert_allclose(
                    distributed.pop("history/loss") * 2, plain.pop("history/loss"),
                    rtol=1e-5,
                )
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
    # The first case builds its layers before keras_dist creates the strategy.
    names.remove("functional_form")
    names.insert(0, "functional_form")
    problems = run_and_compare(tmp_path, names)
    assert not problems, "\n".join(problems)


def test_models_built_after_the_strategy_start_identical(tmp_path):
    """The strategy first, then unseeded models converted: same start everywhere."""
    problems = run_and_compare(
        tmp_path, ["functional_form", "numpy", "subclassed"], first=["--strategy-first"]
    )
    assert not problems, "\n".join(problems)
