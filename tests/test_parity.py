"""Plain Keras on one device vs keras_dist on 2 replicas, feature by feature.

The cases (tests/parity_cases.py) are written as Keras users write them;
each must give the same history, evaluation, predictions and weights as
plain Keras on one device (within 1e-5).
"""

import os
from unittest import mock

import pytest

from helpers import RequestCounter, two_replicas
from parity_cases import CASES, compare, run_case


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_replicas_match_plain_keras(name):
    with RequestCounter() as remote, mock.patch.dict(
        os.environ, {"PARITY_REMOTE_MONITOR": remote.url}
    ):
        distributed, plain = run_case(name, two_replicas())
    if name == "callbacks":
        epochs = len(plain["history/loss"])
        assert remote.by_run() == {"keras_dist": [epochs], "plain": [epochs]}
    problems = compare(distributed, plain)
    assert not problems, f"{name}: " + "; ".join(problems)
