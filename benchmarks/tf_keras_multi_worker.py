"""Scenario 9: the same 2-worker job in keras_dist and in tf-keras (Keras 2).

What a user of `MultiWorkerMirroredStrategy` has today: tf-keras, written
as its multi-worker tutorial shows (model and compile under
`strategy.scope()`, `fit` on NumPy arrays), installed by this harness in a
separate virtual environment (`benchmarks/.venv-tf-keras`, tf_keras only;
TensorFlow is this environment's). Both jobs run `_fit_worker.py`; the
ceiling (2 independent processes with half the batch each, no
communication) is measured alongside.
"""

import functools

from benchmarks import _common, _jobs

KD, TFK, CEILING = ("keras_dist, 2 workers", "tf-keras (Keras 2), 2 workers",
                    "ceiling: 2 independent processes")


def run(args) -> dict:
    _jobs.tf_keras_python()  # created before the first timed job
    plan, results = _jobs.measure(args, {
        KD: functools.partial(_jobs.keras_dist, 2),
        TFK: functools.partial(_jobs.tf_keras, 2),
        CEILING: functools.partial(_jobs.ceiling, 2),
    })
    return {
        "id": 9, "name": "tf_keras_multi_worker",
        "title": "keras_dist vs tf-keras (Keras 2) on the same 2-worker job",
        "setup": _jobs.PROTOCOL.format(**plan) + _jobs.threads_note(2, args.gpu),
        "unit": "samples/s", "rows": _jobs.rows(results),
        "ratios": [
            {"name": "samples/s, keras_dist / tf-keras",
             "value": _jobs.paired(results, KD, TFK, "samples_per_second"),
             "goal": ">= 1.5"},
            {"name": "per-fit start-up, keras_dist / tf-keras",
             "value": _jobs.paired(results, KD, TFK, "startup_median_s"),
             "goal": "<= 1.0"},
            {"name": "samples/s, keras_dist / ceiling",
             "value": _jobs.paired(results, KD, CEILING, "samples_per_second"),
             "goal": ">= 0.85"},
            {"name": "samples/s, tf-keras / ceiling",
             "value": _jobs.paired(results, TFK, CEILING, "samples_per_second")},
        ],
        "notes": "tf_keras is installed matching this TensorFlow's version "
                 "(`tf_keras~=MAJOR.MINOR.0`); both frameworks run the same TensorFlow build.",
    }


if __name__ == "__main__":
    from benchmarks.multi_worker_scaling import parser

    _common.main(run, __doc__, parser())
