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
