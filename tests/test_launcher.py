"""The launcher's supervision, with small scripts that need no TensorFlow."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import keras_dist
from keras_dist import cli


def script(tmp_path, body: str, name="job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


ECHO = """
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
rank = config["task"]["index"]
print("rank", rank, "of", len(config["cluster"]["worker"]), "args", sys.argv[1:])
with open(os.path.join(sys.argv[1], f"config{rank}.json"), "w") as f:
    f.write(os.environ["TF_CONFIG"])
"""


def test_local_workers_get_their_own_tf_config(tmp_path, capfd):
    job = script(tmp_path, ECHO)
    assert keras_dist.launch(job, [str(tmp_path), "x"], num_workers=3) == 0
    out = capfd.readouterr().out
    for rank in range(3):
        assert f"[worker {rank}] rank {rank} of 3 args ['{tmp_path}', 'x']" in out
    configs = [json.loads((tmp_path / f"config{r}.json").read_text()) for r in range(3)]
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3
    assert all(w.startswith("127.0.0.1:") for w in workers)
    assert [c["task"] for c in configs] == [
        {"type": "worker", "index": r} for r in range(3)
    ]
    assert all(c["cluster"]["worker"] == workers for c in configs)


def test_workers_that_never_formed_a_cluster_are_reported(tmp_path, capfd):
    # ECHO never imports keras_dist: 2 independent trainings, exit 0.
    job = script(tmp_path, ECHO)
    assert keras_dist.launch(job, [str(tmp_path)], num_workers=2) == 0
    out = "".join(capfd.readouterr())
    assert (
        "[keras-dist] warning: the 2 workers never formed a multi-worker cluster "
        "(the script never imported keras_dist): each trained a model of its own"
    ) in out
    # Said before the job's last line (its "job finished").
    assert out.index("warning: the 2 workers") < out.rindex("job finished")
    # Workers whose heartbeat says they joined (as keras_dist's strategy
    # writes it): no warning.
    joined = script(tmp_path, """
        import json, os, time
        with open(os.environ["KERAS_DIST_HEARTBEAT"], "w") as f:
            json.dump({"joined": True, "time": time.time(), "steps": 1}, f)
    """, name="joined.py")
    assert keras_dist.launch(joined, [], num_workers=2) == 0
    out = "".join(capfd.readouterr())
    assert "job finished" in out and "never formed" not in out
    # One process is no cluster to form: nothing to say.
    assert keras_dist.launch(job, [str(tmp_path)], num_workers=1) == 0
    assert "never formed" not in "".join(capfd.readouterr())


def test_log_dir(tmp_path, capfd):
    job = script(tmp_path, ECHO)
    logs = tmp_path / "logs"
    assert keras_dist.launch(job, [str(tmp_path)], num_workers=2, log_dir=str(logs)) == 0
    assert "[worker" not in capfd.readouterr().out
    assert "rank 1 of 2" in (logs / "worker-1.log").read_text()


HANG_UNLESS_RANK_1_FAILS = """
import json, os, sys, time
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if rank == 1:
    print("about to fail", flush=True)
    sys.exit(int(sys.argv[1]))
time.sleep(300)  # as if stuck in a collective with the dead worker
"""


@pytest.mark.parametrize("code", [3, -signal.SIGKILL])
def test_one_failure_stops_the_group(tmp_path, capfd, code):
    body = HANG_UNLESS_RANK_1_FAILS
    if code < 0:
        body = body.replace(
            "sys.exit(int(sys.argv[1]))", "os.kill(os.getpid(), signal.SIGKILL)"
        ).replace("import json", "import signal, json")
    job = script(tmp_path, body)
    start = time.monotonic()
    status = keras_dist.launch(job, ["3"], num_workers=3, grace_period=2)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    if code > 0:
        assert status == 3
        assert "worker 1 exited with code 3" in err
    else:
        assert status == 128 + signal.SIGKILL
        assert "worker 1 was killed by SIGKILL" in err
    assert "last lines of worker 1's output (all of it in " in err
    assert "worker-1.log):\nabout to fail" in err
    assert elapsed < 60  # the sleeping workers were stopped, not waited for


def test_max_restarts_restarts_the_group(tmp_path, capfd):
    job = script(
        tmp_path,
        """
        import json, os, sys
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        marker = os.path.join(sys.argv[1], "crashed-once")
        if rank == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(7)
        print("attempt ok", flush=True)
        """,
    )
    assert keras_dist.launch(job, [str(tmp_path)], num_workers=2, max_restarts=1) == 0
    err = capfd.readouterr().err
    assert "restarting the worker group (1/1) because worker 0 exited with code 7" in err
    assert "job finished: 2 worker(s) exited with code 0 after" in err
    assert "and 1 restart(s)" in err


def test_port_conflict_is_retried_with_fresh_ports(tmp_path, capfd):
    job = script(
        tmp_path,
        """
        import json, os, sys
        config = json.loads(os.environ["TF_CONFIG"])
        with open(os.path.join(sys.argv[1], "ports"), "a") as f:
            f.write(config["cluster"]["worker"][0] + "\\n")
        marker = os.path.join(sys.argv[1], "conflicted")
        if config["task"]["index"] == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            print("UnknownError: Could not start gRPC server", flush=True)
            sys.exit(1)
        """,
    )
    assert keras_dist.launch(job, [str(tmp_path)], num_workers=2) == 0
    err = capfd.readouterr().err
    assert "could not bind its port" in err and "retrying with fresh ports (1/3)" in err
    assert "restarting the worker group" not in err
    addresses = set((tmp_path / "ports").read_text().split())
    assert len(addresses) == 2  # the retry used other ports


def test_restarts_are_bounded(tmp_path, capfd):
    job = script(tmp_path, "import sys; sys.exit(5)\n")
    assert keras_dist.launch(job, num_workers=2, max_restarts=2) == 5
    err = capfd.readouterr().err
    assert err.count("restarting the worker group") == 2
    assert "job failed: worker" in err and "(after 2 restart(s))" in err


def test_sigterm_is_forwarded_to_the_workers(tmp_path):
    job = script(
        tmp_path,
        """
        import json, os, signal, sys, time
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        def bye(signum, frame):
            open(os.path.join(sys.argv[1], f"got{rank}-{signum}"), "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(300)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         job, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        ready += "ready" in line
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["job.py", f"got0-{int(signal.SIGTERM)}", f"got1-{int(signal.SIGTERM)}"]
    )
    err = proc.stderr.read()
    assert "received SIGTERM: asking the workers to save a backup within two steps" in err
    # The workers ended on the signal without a keras_dist backup: said last.
    assert err.rstrip().splitlines()[-1] == (
        "[keras-dist] interrupted: the workers exited with code 0"), err


# -- argument errors, before anything starts ---------------------------------


def run_cli(args, capsys):
    status = cli.main(["launch", *args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-workers", "2", "missing.py"], "`script`: no such file. Received: script='missing.py'"),
        (["--num-workers", "0", "JOB"], "option --num-workers. Expected a positive integer. Received: --num-workers 0."),
        (["--hosts", "a:1,b", "--rank", "0", "JOB"], "entry 'b' is not host:port"),
        (["--hosts", "a:1,a:1", "--rank", "0", "JOB"], "'a:1' appears twice"),
        (["--hosts", "a:70000", "--rank", "0", "JOB"], "port in 1-65535"),
        (["--hosts", "a:1,b:2", "--rank", "2", "JOB"], "`--rank`. Expected an integer in [0, 2) for 2 hosts. Received: --rank=2"),
        (["--hosts", "a:1,b:2", "JOB"], "Option --rank is required with --hosts: the index of this host in the list. Received: no --rank"),
        (["--num-workers", "2", "--hosts", "a:1", "JOB"], "mutually exclusive"),
        (["--num-workers", "2", "--max-restarts", "-1", "JOB"], "option --max-restarts. Expected a non-negative integer. Received: --max-restarts -1."),
        (["--num-workers", "2", "--grace-period", "0", "JOB"], "option --grace-period. Expected a positive, finite number of seconds. Received: --grace-period 0.0."),
        (["--num-workers", "2", "--grace-period", "inf", "JOB"], "option --grace-period. Expected a positive, finite number of seconds. Received: --grace-period inf."),
        (["--num-workers", "70000", "JOB"], "option --num-workers. Expected at most "),
        (["--num-workers", "70000", "--print-tf-config"], "option --num-workers. Expected at most "),
        (["--num-workers", "0", "--print-tf-config"], "option --num-workers. Expected a positive integer. Received: --num-workers 0."),
        (["--num-workers", "2", "--log-dir", "FILE/sub", "JOB"], "option --log-dir: 'FILE' exists and is not a directory. Received: --log-dir 'FILE/sub'."),
        (["JOB"], "No cluster given. Pass --num-workers N for N local workers"),
        (["--num-workers", "2", "-m", "no_such_module_here"], "no module of that name"),
        (["--num-workers", "2", "--port", "80", "JOB"], "option --port. Expected an integer from 1024"),
        (["--hosts", "a:1,b:2", "--rank", "0", "--port", "5000", "JOB"], "Option --port applies to local workers (--num-workers N) only. Received: --port 5000"),
        (["--num-workers", "2", "--min-workers", "3", "JOB"], "option --min-workers. Expected at most 2 (the workers of the job). Received: --min-workers 3."),
        (["--num-workers", "2", "--min-workers", "0", "JOB"], "option --min-workers. Expected a positive integer. Received: --min-workers 0."),
        (["--num-workers", "2", "--min-workers", "1", "--rejoin-after", "0", "JOB"], "option --rejoin-after. Expected a positive, finite number of seconds. Received: --rejoin-after 0.0."),
        (["--num-workers", "2", "--rendezvous", "RZ", "JOB"], "Option --rendezvous belongs to elastic multi-host jobs. Received: --rendezvous 'RZ' without --min-workers. Pass --min-workers K too"),
        (["--num-workers", "2", "--min-workers", "1", "--rendezvous", "RZ", "JOB"], "Option --rendezvous applies to multi-host jobs"),
        (["--hosts", "a:1,b:2", "--rank", "0", "--min-workers", "1", "JOB"], "Option --rendezvous is required for an elastic multi-host job"),
        (["--hosts", "a:1,b:2", "--rank", "0", "--min-workers", "1", "--rendezvous", "DONE", "JOB"], "holds a job that ended (`done`)"),
    ],
)
def test_argument_errors(tmp_path, capsys, args, message):
    # Said as the command line says it: flags, not the Python API's names.
    job = script(tmp_path, "raise SystemExit('must not run')\n")
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "done").write_text("{}")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    names = {"JOB": job, "DONE": str(finished), "FILE/sub": str(a_file / "sub")}
    args = [names.get(a, a) for a in args]
    status, err = run_cli(args, capsys)
    assert status == 2
    assert message.replace("'FILE", repr(str(a_file))[:-1]) in err


def test_port_in_use(tmp_path, capsys):
    job = script(tmp_path, "raise SystemExit('must not run')\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        status, err = run_cli(
            ["--hosts", f"127.0.0.1:{port},127.0.0.1:1", "--rank", "0", job], capsys
        )
    assert status == 2
    assert f"Port {port} of this host's worker address '127.0.0.1:{port}' is already in use" in err


def test_print_tf_config_matches_what_each_host_gets(tmp_path, capsys):
    hosts = "127.0.0.1:{},127.0.0.1:{}".format(*_free_ports(2))
    assert cli.main(["launch", "--hosts", hosts, "--print-tf-config"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["rank"] for p in printed] == [0, 1]
    job = script(tmp_path, ECHO)
    for rank in (0, 1):
        # One launcher per "host", as a user would run under ssh.
        assert keras_dist.launch(job, [str(tmp_path)], hosts=hosts, rank=rank) == 0
        received = json.loads((tmp_path / f"config{rank}.json").read_text())
        assert received == printed[rank]["TF_CONFIG"]


def test_print_tf_config_local(capsys):
    assert cli.main(["launch", "--num-workers", "3", "--print-tf-config"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["TF_CONFIG"]["task"]["index"] for p in printed] == [0, 1, 2]


def test_slurm_cluster(tmp_path, capsys):
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_NTASKS": "2",
    }
    from unittest import mock

    with mock.patch.dict("os.environ", env):
        assert cli.main(["launch", "--print-tf-config"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed[1]["TF_CONFIG"] == {
        "cluster": {"worker": ["node1:8888", "node2:8888"]},
        "task": {"type": "worker", "index": 1},
    }


def _free_ports(n):
    from keras_dist._cluster import loopback_ports

    return loopback_ports(n)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"keras-dist {keras_dist.__version__}"


@pytest.mark.parametrize("command", ["launch", "tune"])
def test_help_gives_examples_and_defaults(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert "examples:" in out and f"keras-dist {command} --num-workers 2" in out
    # Each example command on its own lines: a long one continues with "\".
    examples = raw.split("examples:")[1].splitlines()
    for line in examples:
        assert len(line) <= 80 and line.count(" --") <= 4, line
    if command == "launch":
        assert "--min-workers 2 \\\n      --rendezvous" in raw
    assert "(default: 5.0)" in out  # --grace-period
    assert "-m, --module" in out and "-v, --verbose" in out


def test_module_mode(tmp_path, capfd, monkeypatch):
    package = tmp_path / "mypackage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(textwrap.dedent(ECHO))
    monkeypatch.chdir(tmp_path)
    assert cli.main(
        ["launch", "--num-workers", "2", "-m", "mypackage.train", "--", str(tmp_path), "x"]
    ) == 0
    out = capfd.readouterr().out
    assert f"[worker 1] rank 1 of 2 args ['{tmp_path}', 'x']" in out


def test_fixed_port(tmp_path):
    from keras_dist._cluster import consecutive_ports

    for first in range(20000, 60000, 1000):  # a range that is free now
        try:
            consecutive_ports(first, 2)
            break
        except ValueError:
            continue
    job = script(tmp_path, ECHO)
    assert cli.main(["launch", "--num-workers", "2", "--port", str(first), job, str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config1.json").read_text())
    assert config["cluster"]["worker"] == [f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]


LOSES_ITS_PEER = """
import json, os, signal, sys, time
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
out, when = sys.argv[1], sys.argv[2]
dying = os.path.join(out, "dying")

def lost_peer(*_):
    # What a worker prints when the peer it trains with is gone: a long
    # gRPC traceback, then an error exit.
    print("Traceback (most recent call last):", flush=True)
    for i in range(100):
        print(f'  File "collective_ops.py", line {i}, in all_reduce', flush=True)
    print("tensorflow.python.framework.errors_impl.UnavailableError: Collective ops "
          "is aborted by: Connection reset by peer", flush=True)
    sys.exit(1)

if rank == 1:
    print("training", flush=True)
    time.sleep(1.0)
    print("worker 1 dies now", flush=True)
    open(dying, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
if when == "on-stop":  # fails as the launcher stops it
    signal.signal(signal.SIGTERM, lost_peer)
    time.sleep(300)
while not os.path.exists(dying):  # notices the loss as soon as it happens
    time.sleep(0.001)
lost_peer()
"""


@pytest.mark.parametrize("when", ["at-once", "on-stop"])
def test_the_cause_comes_first_and_the_lost_peer_in_one_line(tmp_path, when):
    # Worker 1 is SIGKILLed; worker 0 prints 102 lines of gRPC errors, as
    # soon as its peer dies or as the launcher stops it. The console: the
    # cause first, the consequence in one line, all of it in a few lines.
    job = script(tmp_path, LOSES_ITS_PEER)
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         job, str(tmp_path), when],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stdout
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if "[keras-dist] worker" in line)
    assert lines[first] == "[keras-dist] worker 1 was killed by SIGKILL; stopping the other workers"
    assert len(lines) - first <= 15, done.stdout
    assert not any("collective_ops.py" in line for line in lines), done.stdout
    summary = [line for line in lines if line.startswith("[keras-dist] worker 0 lost its peer: ")]
    assert len(summary) == 1, done.stdout
    assert summary[0].startswith(
        "[keras-dist] worker 0 lost its peer: tensorflow.python.framework.errors_impl."
        "UnavailableError: Collective ops is aborted by: Connection reset by peer (102 lines, "
        "all of its output in "), summary
    log = summary[0].rsplit(" in ", 1)[1].rstrip(")")
    assert open(log).read().count("collective_ops.py") == 100  # all of it, in the file
    assert lines[-1] == "[keras-dist] job failed: worker 1 was killed by SIGKILL"
    assert "worker 1 dies now" in "\n".join(lines[first:])  # its own last lines


NOISY = """
import sys
sys.stderr.write("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
sys.stderr.write("E0000 00:00:1.2 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error\\n")
sys.stderr.write("[keras-dist] cluster formed in 0.1s: a progress line\\n")
print("epoch 1 done", flush=True)
sys.exit(int(sys.argv[1]))
"""


def test_start_up_noise_is_hidden_unless_verbose(tmp_path, capfd):
    job = script(tmp_path, NOISY)
    assert keras_dist.launch(job, ["0"], num_workers=2) == 0
    captured = capfd.readouterr()
    assert "[worker 1] epoch 1 done" in captured.out
    assert "[worker 0] [keras-dist] cluster formed" in captured.out
    assert "cuInit" not in captured.out and "absl" not in captured.out
    assert "[keras-dist] starting 2 worker(s) (127.0.0.1:" in captured.err
    assert "[keras-dist] job finished: 2 worker(s) exited with code 0" in captured.err

    # A failed worker's report has its last lines, without the noise.
    assert keras_dist.launch(job, ["3"], num_workers=1) == 3
    err = capfd.readouterr().err
    assert "last lines of worker 0's output (all of it in" in err and "epoch 1 done" in err
    assert "cuInit" not in err

    assert keras_dist.launch(job, ["0"], num_workers=1, verbose=True) == 0
    out = capfd.readouterr().out
    assert "failed call to cuInit" in out and "absl::InitializeLog" in out


def test_progress_lines_reach_the_console_with_log_dir(tmp_path, capfd):
    job = script(tmp_path, NOISY)
    logs = tmp_path / "logs"
    assert keras_dist.launch(job, ["0"], num_workers=2, log_dir=str(logs)) == 0
    out = capfd.readouterr().out
    assert "[worker 1] [keras-dist] cluster formed in 0.1s" in out
    assert "epoch 1 done" not in out
    log = (logs / "worker-1.log").read_text()
    assert "epoch 1 done" in log and "failed call to cuInit" in log  # all of it


@pytest.mark.parametrize("options", [
    {},
    {"num_workers": 3, "max_restarts": 2, "log_dir": "logs", "grace_period": 2.5,
     "module": True, "port": 23456, "verbose": True, "start_timeout": None,
     "hang_timeout": 12.25, "private_network": True, "min_workers": 1,
     "rejoin_after": 7.5, "gpus_per_worker": 2},
    {"hosts": "a:1,b:2", "rank": 1, "min_workers": 2, "rendezvous": "/shared/rz",
     "start_timeout": 1e-3},
    {"num_workers": 2, "private_network": False},
], ids=["defaults", "local elastic, every option", "multi-host elastic", "open network"])
def test_a_launch_config_reads_back_from_its_command_line(options):
    """The network-namespace relaunch passes the job on as a command line:
    every option comes back the same (one serialisation, one parser)."""
    from keras_dist import cli
    from keras_dist.launchers.config import LaunchConfig

    config = LaunchConfig("train.py", ("--epochs", "3", "--", "-x"), **options)
    args, script_args = cli.parse(config.command_line())
    assert LaunchConfig.from_cli(args, script_args) == config
    inside = LaunchConfig.from_cli(*cli.parse(config.command_line(private_network=False)))
    assert inside == dataclasses.replace(config, private_network=False)
