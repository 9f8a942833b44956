"""Who can reach a local job's workers.

TensorFlow 2.21's gRPC server listens on every interface whatever TF_CONFIG
says (checked here, so the launch guide's statement fails loudly the day
TensorFlow changes). A local job runs in its own network namespace by
default (where one can be made), where nothing outside can reach the
workers; `--no-private-network` opts out, and the console says which.
"""

import json
import os
import subprocess
import sys
import time

import pytest

JOBS = os.path.join(os.path.dirname(__file__), "jobs.py")
pytestmark = pytest.mark.multi_worker


def listeners(port: int) -> list[str]:
    """Local addresses listening on `port` in this process's network namespace."""
    found = []
    for name, _width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    found.append(f"{name} {address}")
    return found


def run_listen_job(tmp_path, *options):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         *options, JOBS, "listen", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        files = [tmp_path / f"listen{r}.json" for r in (0, 1)]
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the job ended early:\n{proc.communicate()[0]}")
            time.sleep(0.2)
        time.sleep(0.5)
        seen = [json.loads(f.read_text()) for f in files]
        found = {s["port"]: listeners(s["port"]) for s in seen}
        (tmp_path / "go").touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    return seen, found, out


def namespaces_work() -> bool:
    probe = subprocess.run(["unshare", "--net", "--map-root-user", "true"],
                           capture_output=True, text=True) if sys.platform == "linux" else None
    return probe is not None and probe.returncode == 0


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp6"), reason="needs Linux /proc")
def test_tensorflow_servers_listen_on_every_interface_without_a_private_network(tmp_path):
    seen, found, out = run_listen_job(tmp_path, "--no-private-network")
    for port, addresses in found.items():
        # tcp6 :: (all zeros) accepts IPv4 and IPv6 connections on any interface.
        assert addresses == ["tcp6 " + "0" * 32], (port, addresses)
    # The console says so, and what to do.
    assert ("[keras-dist] the workers listen on every interface of this host "
            "(--no-private-network was given): reachable from the network; keep "
            "their ports behind a firewall (docs/launch.md, 'Network exposure')") in out


@pytest.mark.parametrize("options", [[], ["--private-network"]], ids=["default", "flag"])
def test_a_local_job_is_unreachable_by_default(tmp_path, options):
    if not namespaces_work():
        pytest.skip("no network namespaces here")
    seen, found, out = run_listen_job(tmp_path, *options)
    assert [s["interfaces"] for s in seen] == [["lo"], ["lo"]]
    assert found == {s["port"]: [] for s in seen}  # nothing listens out here
    assert "[keras-dist] private network: only this job's processes can reach its workers" in out


def test_private_network_is_refused_where_it_cannot_work(tmp_path, monkeypatch):
    import keras_dist
    from keras_dist import _netns

    job = tmp_path / "job.py"
    job.write_text("raise SystemExit('must not run')\n")
    with pytest.raises(ValueError, match="`private_network`.*local job"):
        keras_dist.launch(str(job), hosts="127.0.0.1:1234,127.0.0.1:1235", rank=0,
                          private_network=True)
    with pytest.raises(ValueError, match="Expected True, False or None .* Received: private_network='yes'"):
        keras_dist.launch(str(job), num_workers=2, private_network="yes")
    monkeypatch.setattr(_netns, "_reason_cache", [])
    monkeypatch.setattr(_netns.shutil, "which", lambda name: None)
    monkeypatch.setattr(_netns.sys, "platform", "linux")
    with pytest.raises(ValueError, match="`unshare` command .* not installed.*firewall"):
        keras_dist.launch(str(job), num_workers=2, private_network=True)


def test_without_namespaces_a_local_job_runs_open_and_says_why(tmp_path, monkeypatch, capfd):
    import keras_dist
    from keras_dist import _netns

    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    monkeypatch.setattr(_netns, "_reason_cache", [])
    monkeypatch.setattr(_netns.shutil, "which", lambda name: None)
    monkeypatch.setattr(_netns.sys, "platform", "linux")
    assert keras_dist.launch(str(job), num_workers=2) == 0
    captured = capfd.readouterr()
    assert captured.out.count("ran") == 2
    assert ("[keras-dist] the workers listen on every interface of this host (no private "
            "network here: the `unshare` command (util-linux) is not installed): reachable "
            "from the network; keep their ports behind a firewall") in captured.err
