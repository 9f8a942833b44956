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
    "multi_worker/ray_main.py",
    "sidecar_train_main.py",
    "multi_worker/worker_main.py",
    "multi_worker/backup_main.py",
    "multi_worker/search_main.py",
    "multi_worker/parity_main.py",
    "multi_worker/keras_tuner_main.py",
    "multi_worker/stress_main.py",
    "multi_worker/pod_main.py",
    "dtensor/golden_main.py",
    "reliability/jobs.py",
    "_hidden",
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
    "test_gpus.py", "test_kubernetes.py", "test_data_fingerprint.py", "test_save_requests.py",
}


# Keras imports scikit-learn at start when it is installed (for
# `keras.wrappers`): 0.6-0.8 s of CPU in each of the ~200 TensorFlow
# processes the tests start, none of which uses it (only keras-tuner's
# BayesianOptimization does, in tests/tuner, inside pytest's own processes).
# The same for pandas (0.5 s; Keras' array slicing imports it when present;
# the test extra installs it for Ray, whose test gives its processes it back).
# The processes the tests start find them hidden: tests/_hidden/<name>
# raises ImportError, as where it is not installed.
HIDDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hidden")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist
        config.option.loadscopereorder = False
    # Not in pytest-xdist's controlling process: its workers run the tuner
    # tests that need scikit-learn.
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses",
                                                            None):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [HIDDEN, os.environ.get("PYTHONPATH")]))


def pytest_addoption(parser):
    parser.addoption(
        "--soak", action="store_true",
        help="run soak-sized tests at full size (the elastic job's 20 random "
        "events instead of 4, 50 fits per stress process instead of 24)",
    )


# The longest modules first (their wall time in a full run, longest first),
# the rest in collection order after them: `--dist loadfile` hands modules
# out in this order (pytest_configure turns off xdist's own reordering, by
# number of tests, which put the few-test multi-process modules last), so
# both workers end close together instead of one starting a long module
# while the other has nothing left.
LONGEST_FIRST = [
    "multi_worker/test_elastic_jobs.py", "dtensor/test_sharded_model.py",
    "multi_worker/test_backup_jobs.py", "multi_worker/test_search_jobs.py",
    "test_benchmarks.py", "callbacks/test_backup_and_restore.py",
    "reliability/test_liveness.py", "multi_worker/test_parity_jobs.py", "test_examples.py",
    "dtensor/test_launched_mesh.py",
    "test_distributed_model.py", "callbacks/test_callback_matrix.py", "test_doc_snippets.py",
    "tuner/test_tuner_models.py", "multi_worker/test_multi_worker.py", "test_parity.py",
    "reliability/test_interruptions.py",
]


def _rank(item) -> int:
    path = item.path.as_posix()
    for rank, name in enumerate(LONGEST_FIRST):
        if path.endswith("/tests/" + name):
            return rank
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    import pytest

    items.sort(key=_rank)  # stable: each module's own order kept
    for item in items:
        if item.path.name in FAST_MODULES and item.get_closest_marker("multi_worker") is None:
            item.add_marker(pytest.mark.fast)
