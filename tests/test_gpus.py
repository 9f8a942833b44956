"""GPUs per local worker: `keras-dist launch` gives each worker its own.

The assignment is read and made without TensorFlow and without a GPU (the
launcher's `CUDA_VISIBLE_DEVICES`, or the host's `/dev/nvidia<N>`); the
launched jobs here run scripts that only report what they were given.
"""

import json
import os

import pytest

from keras_dist import cli
from keras_dist.launchers import gpus
from keras_dist.launchers.config import LaunchConfig
from keras_dist.launchers.train import _gpu_environment


def names(count):
    return [str(i) for i in range(count)]


# Each worker's CUDA_VISIBLE_DEVICES for G GPUs x N workers (None: refused).
TABLE = {
    (1, 1): ["0"],
    (1, 2): None,
    (1, 4): None,
    (2, 1): ["0,1"],
    (2, 2): ["0", "1"],
    (2, 4): None,
    (8, 1): ["0,1,2,3,4,5,6,7"],
    (8, 2): ["0,1,2,3", "4,5,6,7"],
    (8, 4): ["0,1", "2,3", "4,5", "6,7"],
}


@pytest.mark.parametrize("count, workers", sorted(TABLE))
def test_the_assignment_table(count, workers):
    expected = TABLE[count, workers]
    if expected is None:
        with pytest.raises(ValueError) as raised:
            gpus.plan(names(count), workers)
        message = str(raised.value)
        assert f"`num_workers`: {workers} workers cannot share this host's {count} GPU(s)" in message
        assert f"Received: num_workers={workers}." in message
        assert f"Start at most {count} worker(s)" in message
        assert "gpus_per_worker=0 to train on the CPUs" in message
        return
    plan = gpus.plan(names(count), workers)
    assert [plan.environment(r) for r in range(workers)] == [
        {"CUDA_VISIBLE_DEVICES": e} for e in expected]
    shares = [set(e.split(",")) for e in expected]
    assert set().union(*shares) == set(names(count))  # every GPU used, once
    assert sum(map(len, shares)) == count


def test_an_uneven_split_is_refused_and_an_explicit_share_leaves_the_rest_idle():
    with pytest.raises(ValueError, match="Start a number of workers that divides 8"):
        gpus.plan(names(8), 3)
    plan = gpus.plan(names(8), 3, gpus_per_worker=2)
    assert [plan.environment(r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == [
        "0,1", "2,3", "4,5"]
    assert plan.describe(3) == (
        "GPUs (CUDA_VISIBLE_DEVICES): worker 0 0,1; worker 1 2,3; worker 2 4,5; "
        "2 of 8 idle")
    with pytest.raises(ValueError) as raised:
        gpus.plan(names(8), 3, gpus_per_worker=3)
    assert str(raised.value) == (
        "Invalid value for argument `gpus_per_worker`: 3 worker(s) x 3 GPU(s) need "
        "9; this host has 8 (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7). Received: "
        "gpus_per_worker=3, num_workers=3. Pass gpus_per_worker=2 or less (0: train "
        "on the CPUs), or start fewer workers.")
    with pytest.raises(ValueError, match="start at most 0 worker"):
        gpus.plan([], 2, gpus_per_worker=1)


def test_no_gpus_changes_nothing_and_zero_hides_them():
    assert gpus.plan([], 4) is None
    plan = gpus.plan(names(2), 2, gpus_per_worker=0)
    assert [plan.environment(r) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    assert "they train on the CPUs" in plan.describe(2)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_a_bad_share_is_refused(value):
    with pytest.raises(ValueError, match=r"`gpus_per_worker`. Expected a non-negative integer"):
        gpus.plan(names(2), 1, gpus_per_worker=value)


@pytest.mark.parametrize("value, expected", [
    ("3,5,6,7", ["3", "5", "6", "7"]),
    (" 1 , 0 ", ["1", "0"]),
    ("GPU-8a1b,GPU-77c2", ["GPU-8a1b", "GPU-77c2"]),
    ("MIG-4f00", ["MIG-4f00"]),
    ("0,-1,2", ["0"]),  # CUDA stops at the first invalid entry
    ("-1", []),
    ("", []),
])
def test_the_launchers_own_visible_devices_are_what_it_hands_out(value, expected, tmp_path):
    (tmp_path / "nvidia0").touch()  # ignored: the variable wins
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": value}, dev=str(tmp_path)) == expected


def test_without_the_variable_the_hosts_nvidia_devices_count(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm",
                 "nvidia-modeset", "nvidia-caps"):
        (tmp_path / name).touch()
    assert gpus.visible_gpus({}, dev=str(tmp_path)) == ["0", "1", "2"]
    assert gpus.visible_gpus({}, dev=str(tmp_path / "missing")) == []


def test_a_multi_host_worker_keeps_its_gpus_unless_asked(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    hosts = {"hosts": "a:1,b:2", "rank": 1}
    assert _gpu_environment(LaunchConfig("t.py", **hosts))(1) == {}
    env = _gpu_environment(LaunchConfig("t.py", gpus_per_worker=2, **hosts))
    assert env(1) == {"CUDA_VISIBLE_DEVICES": "0,1"}  # its host's first share


REPORT = """
import json, os, sys
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(os.path.join(sys.argv[1], f"gpus{rank}.json"), "w") as f:
    json.dump(os.environ.get("CUDA_VISIBLE_DEVICES"), f)
"""


def test_each_launched_worker_gets_its_own_gpus(tmp_path, capfd, monkeypatch):
    job = tmp_path / "job.py"
    job.write_text(REPORT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert cli.main(["launch", "--num-workers", "2", str(job), str(tmp_path)]) == 0
    seen = [json.loads((tmp_path / f"gpus{r}.json").read_text()) for r in range(2)]
    assert seen == ["3,5", "6,7"]
    err = capfd.readouterr().err
    assert "[keras-dist] GPUs (CUDA_VISIBLE_DEVICES): worker 0 3,5; worker 1 6,7\n" in err

    assert cli.main(["launch", "--num-workers", "2", "--gpus-per-worker", "1",
                     str(job), str(tmp_path)]) == 0
    seen = [json.loads((tmp_path / f"gpus{r}.json").read_text()) for r in range(2)]
    assert seen == ["3", "5"]
    assert "worker 0 3; worker 1 5; 2 of 4 idle" in capfd.readouterr().err


def test_an_impossible_split_is_refused_before_any_worker_starts(tmp_path, capsys,
                                                                 monkeypatch):
    job = tmp_path / "job.py"
    job.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    status = cli.main(["launch", "--num-workers", "3", str(job)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(
        "keras-dist launch: error: Invalid value for option --num-workers: 3 workers "
        "cannot share this host's 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1): each worker "
        "needs a GPU of its own"), err
    assert "Received: --num-workers 3." in err
    assert "pass --gpus-per-worker K to give each worker K" in err
    assert "must not run" not in err
    status = cli.main(["launch", "--num-workers", "2", "--gpus-per-worker", "2", str(job)])
    err = capsys.readouterr().err
    assert status == 2
    assert ("option --gpus-per-worker: 2 worker(s) x 2 GPU(s) need 4; this host has 2"
            in err), err
    assert "Received: --gpus-per-worker 2, --num-workers 2." in err
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_auto_communication_is_nccl_where_the_workers_have_gpus(monkeypatch):
    """What a GPU worker's `MultiWorkerMirroredStrategy` all-reduces with,
    decided from the devices TensorFlow lists (faked here: no GPU on CI)."""
    import tensorflow as tf

    from keras_dist import strategy

    implementation = tf.distribute.experimental.CommunicationImplementation
    assert strategy._communication_options("auto").implementation == implementation.RING
    listed = tf.config.list_physical_devices
    fake_gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [fake_gpu] if kind == "GPU" else listed(kind))
    assert strategy._communication_options("auto").implementation == implementation.NCCL
    assert strategy._communication_options("nccl").implementation == implementation.NCCL
    assert strategy._communication_options("ring").implementation == implementation.RING


SEARCH = """
import json, os, sys
with open(os.path.join(sys.argv[1], os.environ["KERASTUNER_TUNER_ID"] + ".json"), "w") as f:
    json.dump(os.environ.get("CUDA_VISIBLE_DEVICES"), f)
"""


@pytest.mark.multi_worker  # the chief imports TensorFlow and keras-tuner: ~15 s
def test_each_tuner_worker_gets_its_own_gpus_and_the_chief_none(tmp_path, capfd,
                                                                monkeypatch):
    """`keras-dist tune`: the tuner workers split the GPUs as a launch's
    workers do; the chief, which trains nothing, reserves none."""
    search = tmp_path / "search.py"
    search.write_text(SEARCH)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert cli.main(["tune", "--num-workers", "2", str(search), str(tmp_path)]) == 0
    seen = {name: json.loads((tmp_path / f"{name}.json").read_text())
            for name in ("chief", "tuner0", "tuner1")}
    assert seen == {"chief": "", "tuner0": "0,1", "tuner1": "2,3"}
    err = capfd.readouterr().err
    assert ("GPUs (CUDA_VISIBLE_DEVICES): worker 0 0,1; worker 1 2,3 (the tuner "
            "workers, in order; the chief trains nothing and gets none)") in err
    assert cli.main(["tune", "--num-workers", "2", "--gpus-per-worker", "1", str(search),
                     str(tmp_path)]) == 0
    seen = {name: json.loads((tmp_path / f"{name}.json").read_text())
            for name in ("chief", "tuner0", "tuner1")}
    assert seen == {"chief": "", "tuner0": "0", "tuner1": "1"}
    assert "worker 0 0; worker 1 1; 2 of 4 idle" in capfd.readouterr().err
    status = cli.main(["tune", "--num-workers", "3", str(search), str(tmp_path)])
    assert status == 2
    assert "Invalid value for option --num-workers: 3 workers cannot share" in (
        capfd.readouterr().err)
