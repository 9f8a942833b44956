"""Scenario 7: wall time of the same distributed search with 1 and 2 tuner workers.

Runs `keras-dist tune --num-workers N examples/tuner_search.py` for each N
in `--workers` (default 1 2), interleaved, `--repeats` times, each search in
a fresh directory with the same seed and trials, and reports the median
wall time (process start to the chief's exit: TensorFlow start-up included)
and the speedup against the first N.

Usage: python -m benchmarks.tuner_walltime [--trials 12] [--epochs 30]
       [--repeats 3]
"""

import os
import subprocess
import sys
import tempfile
import time

from benchmarks import _common

ROOT = _common.ROOT


def search(num_workers, trials, epochs):
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_CONFIG", None)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "keras_dist.cli", "tune",
             "--num-workers", str(num_workers),
             os.path.join(ROOT, "examples", "tuner_search.py"),
             "--trials", str(trials), "--epochs", str(epochs),
             "--directory", directory],
            env=env, capture_output=True, text=True, timeout=3600,
        )
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{num_workers}-worker search failed:\n"
                           + done.stdout[-3000:] + done.stderr[-3000:])
    accuracy = next(
        float(line.rsplit(" ", 1)[-1]) for line in done.stdout.splitlines()
        if "best model: test accuracy" in line
    )
    return seconds, accuracy


def run(args) -> dict:
    trials, epochs = (2, 1) if args.quick else (args.trials, args.epochs)
    accuracy = {}

    def measure(n):
        def once():
            seconds, accuracy[n] = search(n, trials, epochs)
            return seconds
        return once

    times = _common.interleave({n: measure(n) for n in (1, 2)},
                               _common.repeats(args, 3, quick=1), warmup=0)
    rows = [_common.row(f"{n} tuner worker(s)", times[n], best_test_accuracy=accuracy[n])
            for n in (1, 2)]
    return {
        "id": 7, "name": "tuner_walltime",
        "title": "Distributed tuner: the same search with 1 and 2 tuner workers",
        "setup": (
            f"`keras-dist tune --num-workers N examples/tuner_search.py`: RandomSearch, "
            f"{trials} trials of {epochs} epochs (digits MLP), fresh directory per "
            "search, wall time from the command's start to the chief's exit "
            "(TensorFlow start-up of every process included), interleaved."
        ),
        "unit": "s wall", "rows": rows,
        "ratios": [{"name": "speedup, 2 tuner workers over 1",
                    "value": rows[0]["median"] / rows[1]["median"], "goal": "2.0 (ideal)"}],
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--epochs", type=int, default=30)
    _common.main(run, __doc__, p)
