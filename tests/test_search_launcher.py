"""`launch_search` / `keras-dist tune`: argument checks before anything starts."""

import socket

import pytest

import keras_dist
from keras_dist import cli


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "search.py"
    path.write_text("print('never run')\n")
    return str(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 0}, "num_workers=0"),
        ({"num_workers": 2, "workers_per_trial": 0}, "workers_per_trial=0"),
        ({"num_workers": 3, "workers_per_trial": 2}, "must divide"),
        ({"num_workers": 2, "grace_period": 0}, "grace_period=0"),
        ({"num_workers": 2, "finish_timeout": -1}, "finish_timeout=-1"),
        ({"num_workers": 2, "port": 70000}, "port=70000"),
        ({"num_workers": 2, "grace_period": float("inf")}, "finite number of seconds. Received: grace_period=inf"),
        ({"num_workers": 70000}, "Received: num_workers=70000. Start fewer workers"),
    ],
)
def test_bad_arguments(script, kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras_dist.launch_search(script, **kwargs)


def test_missing_script(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        keras_dist.launch_search(str(tmp_path / "nope.py"), num_workers=1)


def test_port_in_use(script, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port} is in use \\(the oracle uses it\\)"):
            keras_dist.launch_search(script, num_workers=1, port=port)
        # The command line has no --hosts to pick from: its own flag is named.
        assert cli.main(["tune", "--num-workers", "1", "--port", str(port), script]) == 2
    err = capsys.readouterr().err
    assert f"option --port: 127.0.0.1:{port} is in use (the oracle uses it). Received: --port {port}." in err
    assert "--hosts" not in err


def test_cli_reports_errors_with_exit_code_2(script, capsys):
    assert cli.main(["tune", "--num-workers", "3", "--workers-per-trial", "2", script]) == 2
    err = capsys.readouterr().err
    assert "keras-dist tune: error:" in err
    # In the command line's words: its flags, not the Python API's names.
    assert "--workers-per-trial" in err and "workers_per_trial" not in err, err


def test_module_mode_runs_every_process_with_its_role(tmp_path, capfd, monkeypatch):
    # A module run as `python -m`, in the chief and each tuner worker, with
    # its arguments; it searches nothing, so every process just exits.
    (tmp_path / "mysearch.py").write_text(
        "import os, sys\n"
        "print('role', os.environ['KERASTUNER_TUNER_ID'], 'args', sys.argv[1:],"
        " 'main', __name__)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tune", "--num-workers", "2", "-m", "mysearch", "--", "a", "b"]) == 0
    out = capfd.readouterr().out
    for label in ("chief", "tuner0", "tuner1"):
        assert f"[{label}] role {label} args ['a', 'b'] main __main__" in out


def test_missing_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no module of that name"):
        keras_dist.launch_search("not_a_module_here", num_workers=1, module=True)


def test_ctrl_c_stops_the_search_quietly_and_says_how_to_resume(tmp_path):
    import signal
    import subprocess
    import sys

    job = tmp_path / "search.py"
    job.write_text("import time\nprint('ready', flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "tune", "--num-workers", "2", str(job)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    while sum("ready" in line for line in lines) < 3:  # the chief and 2 tuner workers
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "[keras-dist] received Ctrl-C: stopping the chief and the tuner workers" in out
    assert out.rstrip().splitlines()[-1] == (
        "[keras-dist] interrupted: run the same command again with overwrite=False in the "
        "tuner to resume the search (trials that were running start over)"), out
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out
