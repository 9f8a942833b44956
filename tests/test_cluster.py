import json
from unittest import mock

import pytest

from keras_dist import _cluster


def test_unset_or_empty_is_none():
    with mock.patch.dict("os.environ", {}, clear=True):
        assert _cluster.parse_tf_config() is None
    assert _cluster.parse_tf_config("  ") is None


def test_ranks_with_and_without_chief():
    with_chief = {
        "cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
        "task": {"type": "worker", "index": 1},
    }
    info = _cluster.parse_tf_config(json.dumps(with_chief))
    assert (info.num_workers, info.rank, info.is_chief) == (3, 2, False)
    no_chief = {"cluster": {"worker": ["h:2", "h:3"]}, "task": {"type": "worker"}}
    info = _cluster.parse_tf_config(json.dumps(no_chief))
    assert (info.num_workers, info.rank, info.is_chief) == (2, 0, True)


def test_unknown_task_type_in_cluster():
    raw = json.dumps({"cluster": {"boss": ["h:1"]}, "task": {"type": "boss"}})
    with pytest.raises(ValueError, match=r"cluster\.boss"):
        _cluster.parse_tf_config(raw)


def test_two_chiefs():
    raw = json.dumps(
        {"cluster": {"chief": ["h:1", "h:2"]}, "task": {"type": "chief"}}
    )
    with pytest.raises(ValueError, match="at most one chief"):
        _cluster.parse_tf_config(raw)


def test_slurm_counts():
    env = {"SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2"}
    with mock.patch.dict("os.environ", env, clear=True):
        assert _cluster.slurm_num_tasks() == 4
        assert _cluster.slurm_num_nodes() == 2
    with mock.patch.dict("os.environ", {}, clear=True):
        assert _cluster.slurm_num_tasks() == 1


@pytest.mark.parametrize("address", ["127.0.0.1:abc", "127.0.0.1:", ":2222", "h:0", "h:70000", "h:+22"])
def test_an_address_without_a_port_number_is_refused_naming_it(address):
    # Checked here, not deep inside TensorFlow's server start.
    raw = json.dumps({"cluster": {"worker": ["h:1", address]},
                      "task": {"type": "worker", "index": 0}})
    with pytest.raises(ValueError) as error:
        _cluster.parse_tf_config(raw)
    assert str(error.value) == (
        "Invalid `TF_CONFIG` environment variable: bad field `cluster.worker`. "
        f"Received: cluster.worker={['h:1', address]!r}. Address {address!r} is not "
        "host:port with a port in 1-65535 (digits only)."
    )


def test_ipv6_and_host_names_with_ports_are_accepted():
    raw = json.dumps({"cluster": {"worker": ["[::1]:2222", "node-1.example:65535"]},
                      "task": {"type": "worker", "index": 1}})
    assert _cluster.parse_tf_config(raw).rank == 1


def test_a_managed_jobs_evaluator_is_outside_the_training(monkeypatch):
    """The TF_CONFIG of Vertex AI, SageMaker and Kubeflow's TFJob: a chief,
    workers and an evaluator that runs the same script but trains nothing."""
    import keras_dist
    from keras_dist import _input_checks, _startup
    from keras_dist.strategy import WorkerInfo

    cluster = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "evaluator": ["h:4"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": "evaluator", "index": 0}}))
    assert keras_dist.worker_info("default") == WorkerInfo(3, -1, False, "evaluator")
    assert not _startup.is_multi_worker_task()
    with pytest.raises(RuntimeError, match=r"^fit\(\): this process is the job's evaluator "
                       r"task .* the chief and the 2 other worker\(s\) train"):
        _input_checks.check_trains_here("fit")
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    _input_checks.check_trains_here("fit")  # a training task: no refusal
    assert _startup.is_multi_worker_task()


def test_worker_info_outside_any_strategy_reads_the_jobs_cluster(monkeypatch):
    """At the top of a script, before any strategy exists, every worker
    already knows which one it is (it was rank 0 and chief on all of them)."""
    import keras_dist
    from keras_dist.strategy import WorkerInfo

    cluster = {"worker": ["h:1", "h:2", "h:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": 2}}))
    assert keras_dist.worker_info() == WorkerInfo(3, 2, False, "worker")
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"chief": ["h:9"], **cluster}, "task": {"type": "chief", "index": 0}}))
    assert keras_dist.worker_info() == WorkerInfo(4, 0, True, "chief")
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert keras_dist.worker_info() == WorkerInfo(4, 3, False)
    monkeypatch.delenv("SLURM_NTASKS")
    assert keras_dist.worker_info() == WorkerInfo(1, 0, True)
