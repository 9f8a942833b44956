"""Scenario 3: data-parallel scaling, 2 workers through `keras-dist launch` vs 1.

The same global batch and steps: one worker, against
a 2-worker `MultiWorkerMirroredStrategy` job started by `keras-dist launch`
on 127.0.0.1, each worker's TensorFlow intra-op pool sized to its share of
the cores (cores // 2, via `tf.config.threading` before TensorFlow starts;
inter-op pools 2); the 1-worker baseline gets one share, and a process with
every core's threads is shown for reference. Jobs alternate; each reports
global samples/s over timed epochs after a warm-up epoch (start-up excluded).
"""

import os
import sys

from benchmarks import _common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_scaling_worker.py")


def job(num_workers: int, threads: int, pin: bool, steps: int, epochs: int,
        batch: int) -> dict:
    script = [WORKER, "--steps", str(steps), "--epochs", str(epochs), "--batch", str(batch),
              "--intra-op-threads", str(threads), *(["--pin"] if pin else [])]
    if num_workers == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers",
                   str(num_workers), *script]
    return _common.result_of(command, f"{num_workers}-worker job")


def run(args) -> dict:
    cores = os.cpu_count() or 1
    per_worker = max(1, cores // 2)
    pin = per_worker == 1 and hasattr(os, "sched_setaffinity")
    steps, epochs = (6, 1) if args.quick else (args.steps, 3)
    share = "1 pinned core" if pin else f"{per_worker} intra-op threads"
    variants = {  # (workers, intra-op threads per worker, pinned)
        f"1 worker, {share}": (1, per_worker, pin),
        f"2 workers (keras-dist launch), {share} each": (2, per_worker, pin),
        f"1 process, all {cores} cores (reference)": (1, cores, False),
    }
    if args.quick:  # the two variants the ratio needs
        variants.pop(f"1 process, all {cores} cores (reference)")
    rates = {name: [] for name in variants}
    strategies = {}
    for _ in range(_common.repeats(args, 3, quick=1)):
        for name, (workers, threads, pinned) in variants.items():
            result = job(workers, threads, pinned, steps, epochs, args.batch)
            rates[name] += result["samples_per_second"]
            strategies[name] = result["strategy"]
    rows = [_common.row(name, rates[name], workers=variants[name][0],
                        strategy=strategies[name]) for name in variants]
    speedup = rows[1]["median"] / rows[0]["median"]
    return {
        "id": 3, "name": "multi_worker_scaling",
        "title": "Data-parallel scaling: 2 launched workers vs 1",
        "setup": (
            f"{cores} CPU cores; {_common.MODEL_SIZES['cnn']} on digits, Adam, global "
            f"batch {args.batch}, {steps} steps per epoch, {epochs} timed epoch(s) per job after "
            "a warm-up epoch (start-up excluded), jobs alternated. Thread pools: each "
            "worker sets TensorFlow's intra-op pool to its share of the cores "
            f"(cores // 2 = {per_worker}) and its inter-op pool to 2 with "
            "tf.config.threading before TensorFlow starts"
            + ("; on 2 cores each worker is also pinned to its own core "
               "(os.sched_setaffinity, core = rank)" if pin else "")
            + ". The 1-worker baseline gets one worker's share."
        ),
        "unit": "samples/s", "rows": rows,
        "ratios": [
            {"name": "speedup, 2 workers over 1 worker", "value": speedup,
             "goal": "2.0 (ideal)"},
            {"name": "scaling efficiency (speedup / 2)", "value": speedup / 2},
        ] + ([{"name": "2 workers over 1 process using every core",
                "value": rows[1]["median"] / rows[2]["median"]}] if len(rows) > 2 else []),
        "notes": "Both workers share one host's memory bandwidth and caches and "
                 "all-reduce over loopback gRPC; each step of a multi-worker job also "
                 "agrees across workers whether input is left.",
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    _common.main(run, __doc__, p)
