"""Splits the CPU into 4 logical devices before TensorFlow initializes."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import keras_dist  # noqa: E402

NUM_LOGICAL_CPUS = 4
keras_dist.simulate_replicas(NUM_LOGICAL_CPUS)

# A script run as a subprocess by the multi-worker tests, not a test module.
collect_ignore = ["multi_worker/worker_main.py"]
