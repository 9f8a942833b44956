"""Splits the CPU into 4 logical devices before TensorFlow initializes."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import keras_dist  # noqa: E402

NUM_LOGICAL_CPUS = 4
keras_dist.simulate_replicas(NUM_LOGICAL_CPUS)

# Scripts run as subprocesses by the multi-worker tests, not test modules.
collect_ignore = [
    "multi_worker/worker_main.py",
    "multi_worker/backup_main.py",
    "multi_worker/search_main.py",
    "multi_worker/parity_main.py",
    "multi_worker/keras_tuner_main.py",
    "multi_worker/stress_main.py",
    "dtensor/golden_main.py",
    "reliability/jobs.py",
]

# The edit loop (`python -m pytest -m fast`, under 2 minutes on 2 cores):
# static checks (API snapshot, architecture and compat pins, docs), argument
# and policy checks against fakes. No TensorFlow job is started and no model
# trained beyond a few steps. A test here that grows past a second or starts
# a training process moves out (`--durations` shows it).
FAST_MODULES = {
    "test_api.py", "test_architecture.py", "test_keras_compat.py", "test_docs.py",
    "test_elastic_policy.py", "test_rendezvous.py", "test_cluster.py", "test_launcher.py",
    "test_strategy.py", "test_collectives.py", "test_kt_compat.py", "test_elastic_agent.py",
}


def pytest_addoption(parser):
    parser.addoption(
        "--soak", action="store_true",
        help="run soak-sized tests at full size (the elastic job's 20 random "
        "events instead of 8, 50 fits per stress process instead of 24)",
    )


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in FAST_MODULES and item.get_closest_marker("multi_worker") is None:
            item.add_marker(pytest.mark.fast)
