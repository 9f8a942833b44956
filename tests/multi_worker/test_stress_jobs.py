"""Many fits in one process: Python-fed and array inputs alternating, garbage
collection forced between fits (tests/multi_worker/stress_main.py).

A Python-fed iterator (a generator, a `PyDataset`, `from_generator`) torn
down while its prefetch thread waits for Python's lock can deadlock the
thread that tears it down; each fit here is bounded (a hung fit dumps every
thread's stack and fails the test), and the process's threads must not grow
with the number of fits.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multi_worker

SCRIPT = os.path.join(os.path.dirname(__file__), "stress_main.py")
LIMIT = 120  # seconds one fit may take


@pytest.fixture
def fits(request) -> int:
    """Fits per process: 50 with `--soak`, 24 otherwise (a thread left
    behind per fit still shows as 12 more between the first and last
    window of 8)."""
    return 50 if request.config.getoption("--soak") else 24


def threads(out: str, prefix: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(rf"{re.escape(prefix)}THREADS (\d+) (\d+)", out)]


def check(out: str, prefixes: list[str], fits: int) -> None:
    assert out.count("DONE") == len(prefixes), out[-6000:]
    assert out.count(f"fit {fits - 1} ") == len(prefixes), out[-6000:]
    window = 8
    for prefix in prefixes:
        counts = threads(out, prefix)
        assert len(counts) == fits - 4, out[-3000:]
        # A process's steady thread count is the least seen over a window of
        # fits: TensorFlow's and gRPC's pools start short-lived threads (up
        # to a dozen more in one sample, measured), never more than a few
        # for long. The steady count of the last fits must be that of the
        # first: Python threads none more (one left per fit would be 12 or
        # more),
        # OS threads at most 2 more.
        early, late = counts[:window], counts[-window:]
        assert min(p for p, _ in late) <= min(p for p, _ in early), counts
        assert min(o for _, o in late) <= min(o for _, o in early) + 2, counts


def progress(out: str, prefix: str = "") -> list[str]:
    """Keras' verbose=2 lines (`Epoch 1/2`; `4/4 - 0s - 3ms/step - loss: 0.1`
    as its step count and logged names: times and values vary)."""
    found = []
    for line in out.splitlines():
        if not line.startswith(prefix):
            continue
        line = line[len(prefix):]
        if re.match(r"Epoch \d+/\d+$", line):
            found.append(line)
        elif re.match(r"\d+/\d+ - ", line):
            found.append(line.split(" ")[0] + " " + ",".join(re.findall(r"(\w+): ", line)))
    return found


ONE_PROCESS = {}


def test_many_fits_on_a_mirrored_strategy(tmp_path, fits):
    done = subprocess.run(
        [sys.executable, SCRIPT, str(fits), str(LIMIT)], capture_output=True, text=True,
        timeout=fits * LIMIT, cwd=tmp_path, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    check(out, [""], fits)
    ONE_PROCESS["progress"] = progress(done.stdout)
    assert len(ONE_PROCESS["progress"]) == 4, done.stdout[-3000:]


def test_many_fits_on_two_launched_workers(tmp_path, fits):
    done = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
         "--hang-timeout", str(LIMIT), SCRIPT, str(fits), str(LIMIT)],
        capture_output=True, text=True, timeout=fits * LIMIT, cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    check(out, ["[worker 0] ", "[worker 1] "], fits)
    # Progress output: the chief's alone, line for line what one process
    # prints (the single-process run above, when it ran first).
    chief, other = progress(done.stdout, "[worker 0] "), progress(done.stdout, "[worker 1] ")
    assert len(chief) == 4 and other == [], done.stdout[-3000:]
    if "progress" in ONE_PROCESS:
        assert chief == ONE_PROCESS["progress"]
