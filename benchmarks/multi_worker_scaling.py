"""Scenario 3: multi-worker data parallelism, per step and per `fit`, against the ceiling.

Three jobs, alternated: 1 worker, 2 workers through `keras-dist launch`
(MultiWorkerMirroredStrategy on 127.0.0.1), and the ceiling: 2 independent
single-worker processes at once, each with half the global batch and no
communication. Each job reports per-step throughput (one long `fit`, timed
by a callback) and per-`fit` start-up (short `fit` calls, their time
outside the steps); see `_jobs.py` and `_fit_worker.py`. The 2-worker job
also counts the host round trips its steps make beyond Keras' own
(keras_dist's collectives outside the step) and trains its long fit a
second time with `BackupAndRestore`.
"""

import functools

from benchmarks import _common, _jobs

ONE, TWO, CEILING = "1 worker", "2 workers (keras-dist launch)", "ceiling: 2 independent processes"


def run(args) -> dict:
    plan, results = _jobs.measure(args, {
        ONE: functools.partial(_jobs.keras_dist, 1),
        TWO: functools.partial(_jobs.keras_dist, 2, backup=True),
        CEILING: functools.partial(_jobs.ceiling, 2),
    })
    return {
        "id": 3, "name": "multi_worker_scaling",
        "title": "Multi-worker data parallelism: 2 launched workers vs the ceiling and 1 worker",
        "setup": _jobs.PROTOCOL.format(**plan) + _jobs.threads_note(2, args.gpu),
        "unit": "samples/s", "rows": _jobs.rows(results),
        "ratios": [
            {"name": "samples/s, 2 workers / ceiling (2 independent processes)",
             "value": _jobs.paired(results, TWO, CEILING, "samples_per_second"),
             "goal": ">= 0.85"},
            {"name": "speedup, 2 workers over 1 worker",
             "value": _jobs.paired(results, TWO, ONE, "samples_per_second"),
             "goal": "2.0 (ideal)"},
            {"name": "per-fit start-up, 2 workers / 1 worker",
             "value": _jobs.paired(results, TWO, ONE, "startup_median_s")},
            {"name": "samples/s, 2 workers with BackupAndRestore / without (same job)",
             "value": _jobs.paired(results, TWO, TWO, "backup_samples_per_second",
                                   "samples_per_second"),
             "goal": ">= 0.97"},
            {"name": "host round trips per step beyond Keras' own, 2 workers with "
                     "BackupAndRestore: keras_dist collectives outside the step",
             "value": _jobs.median(results, TWO, "backup_agreements_per_step"),
             "goal": "0"},
            {"name": "the same, per fit (choosing the backup, each epoch's save, the end)",
             "value": _jobs.median(results, TWO, "backup_agreements_per_fit")},
        ],
        "notes": "The ceiling is what 2 workers could reach on this machine with free "
                 "communication: both processes share one host's memory bandwidth and "
                 "caches, as the workers do. The workers all-reduce over loopback gRPC.",
    }


def parser():
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=30, help="steps per epoch of the long fit")
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU per process (NCCL, mixed_float16) instead of CPU cores")
    return p


if __name__ == "__main__":
    _common.main(run, __doc__, parser())
