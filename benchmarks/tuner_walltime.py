"""Wall time of the same distributed search with 1 and 2 tuner workers.

Runs `keras-dist tune --num-workers N examples/tuner_search.py` for each N
in `--workers` (default 1 2), interleaved, `--repeats` times, each search in
a fresh directory with the same seed and trials, and reports the median
wall time (process start to the chief's exit: TensorFlow start-up included)
and the speedup against the first N.

Usage: python benchmarks/tuner_walltime.py [--trials 8] [--epochs 8]
       [--repeats 3] [--workers 1 2]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(num_workers, trials, epochs):
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
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    accuracy = next(
        (line.rsplit(" ", 1)[-1] for line in done.stdout.splitlines()
         if "best model: test accuracy" in line),
        "?",
    )
    return seconds, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    times = {n: [] for n in args.workers}
    accuracy = {}
    for _ in range(args.repeats):
        for n in args.workers:
            seconds, accuracy[n] = run(n, args.trials, args.epochs)
            times[n].append(seconds)
    base = statistics.median(times[args.workers[0]])
    print(
        f"# examples/tuner_search.py: RandomSearch, {args.trials} trials of "
        f"{args.epochs} epochs (digits MLP), median of {args.repeats} "
        "interleaved runs"
    )
    print("| tuner workers | wall time (median) | spread | speedup | best test accuracy (last run) |")
    print("|---|---|---|---|---|")
    for n in args.workers:
        median = statistics.median(times[n])
        print(
            f"| {n} | {median:.1f} s | {min(times[n]):.1f}-{max(times[n]):.1f} s | "
            f"{base / median:.2f}x | {accuracy[n]} |"
        )


if __name__ == "__main__":
    main()
