"""A job never hangs silently: stuck, stalled and stopped workers are named.

The unit tests drive the launcher's `Watch` with heartbeat files written by
the test and a real stopped process; the job tests launch real 2-worker jobs
(`keras-dist launch`) and check the launcher's report, its exit status
(124) and the time it took.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from keras_dist import _liveness

JOBS = os.path.join(os.path.dirname(__file__), "jobs.py")


def beat(path, **fields):
    payload = dict({"joined": False, "joining": False, "active": True, "steps": 0,
                    "progress": time.time(), "in_step": False, "where": "t.py:1 in f"},
                   **fields)
    payload["time"] = fields.get("time", time.time())
    with open(path, "w") as f:
        json.dump(payload, f)


def test_a_stopped_process_is_reported_after_the_window(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = str(tmp_path / "hb")
        watch = _liveness.Watch(sleeper.pid, path, True, _liveness.Timeouts(start=None))
        beat(path, joined=True)
        assert watch.check() is None
        os.kill(sleeper.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert watch.check() is None  # the window starts
        watch.quiet_since -= _liveness.STOPPED_AFTER
        rank, problem = watch.check()
        assert rank == 0 and "stopped (state T" in problem
        os.kill(sleeper.pid, signal.SIGCONT)
        time.sleep(0.2)
        beat(path, joined=True)
        assert watch.check() is None  # running again: forgiven
    finally:
        sleeper.kill()
        sleeper.wait()


def test_start_and_hang_limits_and_who_is_blamed(tmp_path):
    path = str(tmp_path / "hb")
    pid = os.getpid()  # running, never stopped
    limits = _liveness.Timeouts(start=10, hang=20)
    watch = _liveness.Watch(pid, path, True, limits)
    watch.started -= 11
    assert "never even imported keras_dist" in watch.check()[1]
    beat(path)
    rank, problem = watch.check()
    assert rank == 1 and "no multi-worker strategy was created" in problem
    beat(path, joining=True)
    rank, problem = watch.check()
    assert rank == 2 and "waited for the other workers" in problem
    beat(path, joined=True, steps=7, progress=time.time() - 5)
    assert watch.check() is None
    beat(path, joined=True, steps=7, progress=time.time() - 25, where="train.py:9 in cb")
    rank, problem = watch.check()
    assert rank < 4 and "made no step for 25s" in problem and "train.py:9 in cb" in problem
    beat(path, joined=True, steps=7, progress=time.time() - 25, in_step=True)
    rank, problem = watch.check()
    assert rank > 4 and "inside a step" in problem
    # Between tuner trials a worker may wait as long as the search needs.
    beat(path, joined=True, steps=7, progress=time.time() - 25, active=False)
    assert watch.check() is None
    # A single process (no cluster) is held to the hang limit once it stepped.
    single = _liveness.Watch(pid, path, False, limits)
    single.started -= 100
    beat(path, steps=0, progress=time.time() - 25)
    assert single.check() is None
    beat(path, steps=3, progress=time.time() - 25)
    assert "made no step" in single.check()[1]


def test_the_worker_outside_any_step_is_blamed_not_the_one_waiting_for_it(tmp_path):
    # Worker 1 sleeps in a callback; worker 0 waits for it inside a step or
    # a keras_dist collective (a backup's agreement) and runs out of time
    # first (its last step ended a little earlier): worker 1 is named.
    from types import SimpleNamespace

    from keras_dist.launchers.supervisor import Group

    limits = _liveness.Timeouts(start=None, hang=20)
    workers = []
    for rank, (in_step, idle, where) in enumerate(
            [(True, 22, "t.py:1 in f"), (False, 19, "train.py:56 in on_train_batch_end")]):
        path = str(tmp_path / f"hb{rank}")
        beat(path, joined=True, steps=21, progress=time.time() - idle, in_step=in_step,
             where=where)
        proc = SimpleNamespace(poll=lambda: None, pid=os.getpid())
        workers.append(SimpleNamespace(label=f"worker {rank}", proc=proc,
                                       watch=_liveness.Watch(os.getpid(), path, True, limits)))
    group = SimpleNamespace(_next_check=0.0, workers=workers)
    worker, problem = Group.unresponsive(group)
    assert worker.label == "worker 1", problem
    assert "made no step for 19s (limit 20s), at train.py:56 in on_train_batch_end" in problem
    assert "outside any step while the others wait for it" in problem
    # Both outside a step (each in its own code): the one past the limit.
    beat(str(tmp_path / "hb0"), joined=True, steps=21, progress=time.time() - 22)
    group._next_check = 0.0
    worker, problem = Group.unresponsive(group)
    assert worker.label == "worker 0" and "made no step for 22s" in problem
    # A peer that stepped recently is not blamed for the one inside a step.
    beat(str(tmp_path / "hb0"), joined=True, steps=21, progress=time.time() - 22,
         in_step=True)
    beat(str(tmp_path / "hb1"), joined=True, steps=23, progress=time.time() - 2)
    group._next_check = 0.0
    worker, problem = Group.unresponsive(group)
    assert worker.label == "worker 0" and "inside a step" in problem


def test_a_keras_dist_collective_counts_as_inside_a_step(monkeypatch, tmp_path):
    monkeypatch.setattr(_liveness, "_path", str(tmp_path / "hb"))
    monkeypatch.setitem(_liveness._state, "in_step", False)
    with _liveness.in_collective():
        assert _liveness._state["in_step"] is True
    assert _liveness._state["in_step"] is False


def test_bad_timeouts_are_refused_before_anything_starts(tmp_path):
    import keras_dist

    job = tmp_path / "job.py"
    job.write_text("raise SystemExit('must not run')\n")
    for name, value in (("start_timeout", 0), ("hang_timeout", -5), ("hang_timeout", "1")):
        with pytest.raises(ValueError, match=f"`{name}`.*Received: {name}={value!r}"):
            keras_dist.launch(str(job), num_workers=2, **{name: value})
    with pytest.raises(ValueError, match="start_timeout"):
        keras_dist.launch_search(str(job), num_workers=1, start_timeout=False)


def launch(out_dir, kind, *options, timeout=240):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         *options, JOBS, kind, str(out_dir)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.mark.multi_worker
def test_a_worker_stuck_before_joining_is_named_and_the_group_restarts(tmp_path):
    code, out, _ = launch(tmp_path, "prejoin", "--start-timeout", "30", "--max-restarts", "1")
    assert code == 0, out
    assert ("worker 1 never joined the cluster within 30s (keras_dist was imported, "
            "but no multi-worker strategy was created)") in out
    assert "worker 0: waiting for the other workers to join" in out
    # The long wait (7.5 s: a quarter of the limit) was said once, before
    # the limit, naming who was missing.
    waits = re.findall(r"worker 0 waited (\d+)s for the other workers to join the cluster; "
                       r"not joining yet: worker 1 \(no multi-worker strategy created yet\); "
                       r"the job stops at --start-timeout 30s", out)
    assert len(waits) == 1 and 7 <= int(waits[0]) < 30, out
    assert "restarting the worker group (1/1) because worker 1 never joined" in out
    assert out.count("trained") == 2


@pytest.mark.multi_worker
def test_a_worker_stalled_after_joining_is_named(tmp_path):
    code, out, seconds = launch(tmp_path, "stall", "--hang-timeout", "15")
    assert code == 124, out
    assert "worker 1 made no step for" in out
    assert "at jobs.py:" in out and "in on_train_batch_end" in out
    # Worker 0 waits in BackupAndRestore's end-of-step agreement (a
    # keras_dist collective: counted as inside a step), so worker 1 is named
    # whichever of the two runs out of time first.
    assert re.search(r"worker 0: 21 step\(s\), last progress \d+s ago, inside a step", out), out
    assert "job failed: worker 1 made no step" in out
    assert seconds < 150, out


@pytest.mark.multi_worker
def test_a_worker_waiting_for_a_killed_peer_is_released_at_once(tmp_path):
    """Worker 0 waits in a collective outside any step (a backup's
    agreement) when worker 1 is SIGKILLed: the launcher tells it its peer
    is gone, its collective fails, and it ends through its own error path
    long before the grace period (which it waited out before)."""
    code, out, seconds = launch(tmp_path, "abandoned", "--grace-period", "90")
    assert code != 0, out
    assert "worker 1 was killed by SIGKILL; stopping the other workers" in out, out
    assert "collective failed, aborted by the launcher: True" in out, out
    assert seconds < 60, out


@pytest.mark.multi_worker
def test_a_stopped_worker_is_named_within_seconds(tmp_path):
    """SIGSTOP (a stuck host, a partition) is named before TensorFlow gives up."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         JOBS, "train", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        pid_file = tmp_path / "pid1"
        deadline = time.monotonic() + 180
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pid_file.exists(), "worker 1 never formed its cluster"
        time.sleep(3)  # training
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 124, out
    assert "worker 1 stopped responding: its process" in out
    assert "job failed: worker 1 stopped responding" in out
    # Default settings: named within well under a minute (measured: ~6 s).
    assert seconds < 45, out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multi_worker
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
@pytest.mark.parametrize("network", ["shared", "private"])
def test_workers_die_with_a_killed_launcher(tmp_path, network):
    # SIGKILL the launcher (the OOM killer, a lost login shell, a
    # scheduler's hard kill) while its workers train: they stop within
    # seconds, their heartbeat folder is removed, and nothing writes on.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               TMPDIR=str(tmp_path))
    env.pop("TF_CONFIG", None)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    options = ["--private-network" if network == "private" else "--no-private-network"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", *options,
         JOBS, "train", str(out_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not all((out_dir / f"pid{r}").exists() for r in (0, 1)):
            assert launcher.poll() is None and time.monotonic() < deadline, \
                launcher.stderr and launcher.stderr.read()[-3000:]
            time.sleep(0.5)
        time.sleep(0.5)
        pids = [int((out_dir / f"pid{r}").read_text()) for r in (0, 1)]
        assert all(alive(pid) for pid in pids)
        assert list(tmp_path.glob("keras_dist_heartbeat_*"))
        launcher.kill()
        killed = time.monotonic()
        launcher.wait()
        while any(alive(pid) for pid in pids) and time.monotonic() - killed < 60:
            time.sleep(0.2)
        seconds = time.monotonic() - killed
        assert not any(alive(pid) for pid in pids), f"workers alive {seconds:.0f}s after"
        while list(tmp_path.glob("keras_dist_heartbeat_*")) and time.monotonic() - killed < 60:
            time.sleep(0.2)  # the inner launcher removes it after its workers' exit
    finally:
        for r in (0, 1):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((out_dir / f"pid{r}").read_text()), signal.SIGKILL)
    # Within a few heartbeats (measured: 0.2-1.0 s; under the private
    # network the launcher inside the namespace goes first, then its workers).
    assert seconds < 5, seconds
    assert not list(tmp_path.glob("keras_dist_heartbeat_*"))


@pytest.mark.multi_worker
def test_a_hung_tuner_worker_is_stopped_and_the_search_completes(tmp_path):
    from multi_worker.test_search_jobs import explain, runs, summary, tune

    job = tune(tmp_path, "--num-workers", "2", "--hang-timeout", "10",
               args=["trials=4", "stall=tuner1", "die_at=2", "retries=1", "sleep=0.5"])
    assert job.returncode == 0, explain(job)
    assert "tuner1 made no step for" in job.stderr, explain(job)
    assert "in run_trial" in job.stderr
    assert "tuner worker tuner1 hung (" in job.stderr
    assert summary(tmp_path)["trials"] == {str(i): "COMPLETED" for i in range(4)}
    started = runs(tmp_path)
    lost = started["tuner1-0"][-1]
    assert started["tuner0-0"].count(lost) == 1  # retried by the other worker


def test_only_the_launchers_own_children_beat(tmp_path):
    """A process a worker spawns (a data-loading worker re-importing
    keras_dist) inherits the environment but must not overwrite the
    worker's heartbeat."""
    code = ("import time, keras_dist; from keras_dist import _liveness; "
            "time.sleep(1.5); print(_liveness._path is not None)")
    results = {}
    for who, parent in (("child", str(os.getpid())), ("grandchild", "1")):
        path = tmp_path / who
        env = dict(os.environ, **{_liveness.ENV: str(path), _liveness.PARENT_ENV: parent})
        done = subprocess.run([sys.executable, "-c", code], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        results[who] = (done.stdout.strip(), path.exists())
    assert results == {"child": ("True", True), "grandchild": ("False", False)}
    payload = json.loads((tmp_path / "child").read_text())
    assert payload["joined"] is False and payload["steps"] == 0 and "where" in payload
