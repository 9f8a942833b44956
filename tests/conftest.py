"""Splits the CPU into 4 logical devices before TensorFlow initializes."""

import os

import pytest

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
    "_budget",
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
    _cpu_budget_configure(config)
    # Not in pytest-xdist's controlling process: its workers run the tuner
    # tests that need scikit-learn.
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses",
                                                            None):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [HIDDEN, os.environ.get("PYTHONPATH")]))


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-budget", action="store_true",
        help="after the run, list the modules that took the most CPU time: in "
        "pytest's own processes and in every Python process their tests started "
        "(wall times under load mislead: a test measured 7.6 s alone took 31.9 s "
        "in a full run)",
    )
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
    items.sort(key=_rank)  # stable: each module's own order kept
    for item in items:
        if item.path.name in FAST_MODULES and item.get_closest_marker("multi_worker") is None:
            item.add_marker(pytest.mark.fast)


# --cpu-budget: where the suite's CPU time goes, module by module. Every
# Python process a test starts finds tests/_budget/sitecustomize.py first on
# its path and logs its CPU time at exit, named by the test that started it;
# pytest's own processes log each test's CPU time around it.
BUDGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_budget")
CPU_LOG = "KERAS_DIST_TEST_CPU_LOG"
_owns_cpu_log = []  # [path] in the process that made the log (it writes the table)


def _cpu_budget_configure(config):
    if not config.getoption("--cpu-budget"):
        return
    if not os.environ.get(CPU_LOG):  # the controlling process: workers inherit
        import tempfile

        handle, os.environ[CPU_LOG] = tempfile.mkstemp(prefix="cpu-budget-", suffix=".jsonl")
        os.close(handle)
        _owns_cpu_log.append(os.environ[CPU_LOG])
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [BUDGET, os.environ.get("PYTHONPATH")]))
    import atexit
    import sys

    hook = sys.modules.get("sitecustomize")
    if getattr(hook, "__file__", "").startswith(BUDGET):
        atexit.unregister(hook._record)  # pytest's own CPU is counted per test


def _log_cpu(record: dict) -> None:
    import json

    with open(os.environ[CPU_LOG], "a") as log:
        log.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get(CPU_LOG):
        yield
        return
    import resource

    def cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    started = cpu()
    yield
    _log_cpu({"test": item.nodeid, "cpu": cpu() - started, "in_pytest": True})


def pytest_sessionfinish(session):
    """This pytest process's CPU time outside its tests (start-up, collection)."""
    if not os.environ.get(CPU_LOG) or (
            os.environ.get("PYTEST_XDIST_WORKER") is None
            and getattr(session.config.option, "numprocesses", None)):
        return  # xdist's controlling process: counted by its terminal summary
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _log_cpu({"test": "", "cpu": usage.ru_utime + usage.ru_stime, "pytest_total": True})


def pytest_terminal_summary(terminalreporter, config):
    if not _owns_cpu_log or not os.path.exists(_owns_cpu_log[0]):
        return
    path = _owns_cpu_log[0]
    import collections
    import json

    modules = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
    pytest_total = 0.0
    with open(path) as log:
        for line in log:
            record = json.loads(line)
            if record.get("pytest_total"):
                pytest_total += record["cpu"]
                continue
            module = record["test"].split("::")[0] or "(outside any test)"
            row = modules[module]
            if record.get("in_pytest"):
                row[0] += record["cpu"]
            else:
                row[1] += record["cpu"]
                row[2] += 1
                row[3] += record["tensorflow"]
    if pytest_total:  # pytest's own start-up and collection, in each process
        modules["(pytest: start-up, collection)"][0] += pytest_total - sum(
            r[0] for r in modules.values())
    total = sum(r[0] + r[1] for r in modules.values())
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU time by module: {total:.0f} s in all")
    write("  total  in pytest  in processes started  processes (TensorFlow)  module")
    for module, (inside, started, count, with_tf) in sorted(
            modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:25]:
        write(f"{inside + started:6.0f}s {inside:9.0f}s {started:21.0f}s "
              f"{count:10d} ({with_tf:10d})  {module}")
    write("(a process killed by a signal is not counted; --durations' wall times "
          "include the waits for the CPU)")
    os.remove(path)
