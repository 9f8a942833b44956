"""`keras-dist launch --kubernetes` in processes that have what a pod has.

Each "pod" is a process in its own UTS and mount namespaces: its host name
is `train-<index>` (as an Indexed Job names it), its /etc/hosts gives its
fully qualified name first (as Kubernetes writes it for a pod with a
subdomain) and maps every pod's name under the headless Service's domain to
127.0.0.1 (what the cluster's DNS answers with the pods' addresses), and it
has `JOB_COMPLETION_INDEX`. Each runs the command the generated manifest
gives its container; nothing else tells them about each other.
"""

import json
import os
import random
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_dist import _cluster
from keras_dist.launchers import kubernetes

pytestmark = pytest.mark.multi_worker

SCRIPT = os.path.join(os.path.dirname(__file__), "pod_main.py")
DOMAIN = "train.default.svc.cluster.local"


def can_make_pods() -> str | None:
    try:
        done = subprocess.run(["unshare", "--uts", "--mount", "true"],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        return str(e)
    return None if done.returncode == 0 else done.stderr.strip()


def free_base_port(count: int) -> int:
    for _ in range(50):
        base = random.randrange(20000, 60000)
        try:
            _cluster.consecutive_ports(base, count)
            return base
        except ValueError:
            continue
    raise AssertionError("no free consecutive ports")


def test_two_pods_of_an_indexed_job_train_to_one_devices_weights(tmp_path):
    reason = can_make_pods()
    if reason is not None:
        pytest.skip(f"no UTS/mount namespaces here: {reason}")
    port = free_base_port(2)
    _, job = kubernetes.manifests("train", "img", 2, [SCRIPT, str(tmp_path)], port=port)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["keras-dist", "launch"]
    pods = []
    for index in range(2):
        hosts = tmp_path / f"hosts-{index}"
        names = [index] + [i for i in range(2) if i != index]  # its own line first
        hosts.write_text("".join(f"127.0.0.1 train-{i}.{DOMAIN} train-{i}\n" for i in names)
                         + "127.0.0.1 localhost\n")
        env = dict(os.environ, JOB_COMPLETION_INDEX=str(index), CUDA_VISIBLE_DEVICES="",
                   TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        pods.append(subprocess.Popen(
            ["unshare", "--uts", "--mount", "sh", "-c",
             'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
             "pod", f"train-{index}", str(hosts),
             sys.executable, "-m", "keras_dist.cli", *command[1:]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for pod in pods:
            outputs.append(pod.communicate(timeout=300)[0])
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
    shown = "\n".join(f"--- pod {i} (exit {p.returncode}) ---\n{o[-4000:]}"
                      for i, (p, o) in enumerate(zip(pods, outputs)))
    assert all(p.returncode == 0 for p in pods), shown

    expected = [f"train-0.{DOMAIN}:{port}", f"train-1.{DOMAIN}:{port + 1}"]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["TF_CONFIG"] == {"cluster": {"worker": expected},
                                       "task": {"type": "worker", "index": rank}}
        assert "MultiWorkerMirroredStrategy: 2 replicas, 2 workers" in record["strategy"]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    count = sum(k.startswith("final") for k in ranks[0].files)
    for key in [f"initial{i}" for i in range(count)] + [f"final{i}" for i in range(count)]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)

    # One device, from the same initial weights, on the same batches.
    x = np.linspace(-1, 1, 64 * 4, dtype="float32").reshape(64, 4)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.set_weights([ranks[0][f"initial{i}"] for i in range(count)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        validation_split=0.25)
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(ranks[0][f"final{i}"], weight, atol=1e-5, err_msg=f"final{i}")
    # Every logged number (loss, mae, val_loss, val_mae), on both pods.
    assert sorted(history.history) == ["loss", "mae", "val_loss", "val_mae"]
    for rank in ranks:
        assert sorted(k for k in rank.files if k.startswith("history/")) == [
            f"history/{k}" for k in sorted(history.history)]
        for key, values in history.history.items():
            np.testing.assert_allclose(rank[f"history/{key}"], values, rtol=1e-5, err_msg=key)
