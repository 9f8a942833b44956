"""Runs a search script in a process started by `keras-dist tune`.

`python -m keras_dist._tune_run SCRIPT ARGS...` (or `-m MODULE ARGS...`) runs
the user's script as `python SCRIPT ARGS...` would, after preparing
keras-tuner for the process's role, so that a plain keras-tuner script (a
`keras_tuner.RandomSearch`, with no keras_dist in it) runs unchanged:

- on the chief, each trial the oracle ends prints one progress line (trial,
  hyperparameters, score, best so far) for the launcher's console;
- on a tuner worker, `overwrite=True` starts only the worker's own state
  afresh (keras-tuner would have every process delete the shared project
  directory, the chief's included, while the others use it);
- a worker of a trial group (`--workers-per-trial M > 1`) refuses a tuner
  that cannot train one trial across the group, naming the fix;
- every process carries the search's secret to the oracle and the chief
  answers no call without it (`keras_dist.tuner._oracle`); it is taken out
  of the environment before the script runs;
- on a tuner worker, what the script prints after `search()` returns is
  dropped: the chief prints the results, once, as one process would; the
  chief's oracle shows one line per trial instead of keras-tuner's tables,
  and is saved after every ended trial (a finished search run again with
  `overwrite=False` trains nothing).

keras_dist's own tuners (`keras_dist.tuner`) do the worker-side parts
themselves; the chief's progress line is printed for every tuner.
"""

from __future__ import annotations

import functools
import math
import os
import runpy
import shutil
import sys

_USAGE = "usage: python -m keras_dist._tune_run (SCRIPT | -m MODULE) [ARGS...]"


def _say(message: str) -> None:
    sys.stderr.write(f"[keras-dist] {message}\n")
    sys.stderr.flush()


def _trial_number(oracle, trial_id: str) -> int:
    """keras-tuner's number of a trial ("Trial 4"): its place in creation order."""
    return list(oracle.trials).index(trial_id) + 1


def _format_trial(trial, oracle) -> str:
    values = ", ".join(f"{k}={v!r}" for k, v in trial.hyperparameters.values.items())
    name = getattr(oracle.objective, "name", "score")
    score = "no score" if trial.score is None else f"{name} {trial.score:.6g}"
    number = _trial_number(oracle, trial.trial_id)
    line = f"trial {number} {trial.status.lower()}: {score}; {values}"
    best = oracle.get_best_trials(1)
    if best and best[0].score is not None:
        line += (
            f"; best so far: trial {_trial_number(oracle, best[0].trial_id)}, "
            f"{name} {best[0].score:.6g}"
        )
    return line


def _report_trials(start_server):
    """Wraps keras-tuner's `oracle_chief.start_server(oracle)` or keras_dist's
    `_oracle.serve(oracle, ...)` (chief only)."""

    @functools.wraps(start_server)
    def serve(oracle, *args, **kwargs):
        end_trial = oracle.end_trial

        def reporting_end_trial(trial, *args, **kwargs):
            result = end_trial(trial, *args, **kwargs)
            # keras-tuner saves the oracle before it takes the trial off the
            # ongoing list, and nothing saves after the last trial: a finished
            # search re-run with overwrite=False would train it again.
            _save(oracle)
            _say(_format_trial(oracle.trials[trial.trial_id], oracle))
            return result

        oracle.end_trial = reporting_end_trial  # this oracle object only
        # The chief trains nothing: its one line per trial replaces
        # keras-tuner's "Search: Running Trial #N" tables.
        oracle.verbose = 0
        _say(
            f"oracle ready: {type(oracle).__name__}, objective "
            f"{getattr(oracle.objective, 'name', oracle.objective)}, "
            f"max_trials {oracle.max_trials}"
        )
        return start_server(oracle, *args, **kwargs)

    return serve


def _plain_server(serve):
    """`oracle_chief.start_server(oracle)` for a plain keras-tuner script."""

    @functools.wraps(serve)
    def start_server(oracle):
        return serve(oracle, worker_timeout=math.inf)

    return start_server


def _save(oracle) -> None:
    from keras_dist.tuner import _kt_compat as kt

    kt.synchronized(type(oracle).save)(oracle)


def _quiet_after_search(search):
    """Wraps `BaseTuner.search` on a tuner worker: what the script prints
    after its search (results summary, best model summary) comes from the
    chief alone, as from one plain process."""

    @functools.wraps(search)
    def quiet_after(self, *args, **kwargs):
        if sys.stdout is not sys.__stdout__:
            sys.stdout = sys.__stdout__  # a second search() shows its progress
        result = search(self, *args, **kwargs)
        sys.stdout = _Discard()  # see docs/tuner.md: one process's output
        return result

    return quiet_after


class _Discard:
    """A standard output that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _prepare_chief(init):
    """Wraps `BaseTuner.__init__` on the chief: `overwrite=True` clears the
    project directory while the tuner workers, started at the same moment,
    remove their own state files from it (`worker_overwrite`); keras-tuner's
    own recursive delete fails on a file that vanishes under it."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if kwargs.get("overwrite", False):
            project = os.path.join(
                str(kwargs.get("directory") or "."),
                str(kwargs.get("project_name") or "untitled_project"),
            )
            shutil.rmtree(project, ignore_errors=True)
        init(self, *args, **kwargs)

    return __init__


def _prepare_worker(init, in_group: bool):
    """Wraps `BaseTuner.__init__` on a tuner worker."""
    from keras_dist.tuner.distributed_tuner import DistributedTuner, worker_overwrite

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not isinstance(self, DistributedTuner):
            if in_group:
                cls = type(self)
                where = cls.__module__.split(".")[0]
                if where != "keras_tuner":
                    where = cls.__module__
                _say(
                    f"error: {where}.{cls.__name__} "
                    "trains each trial in one process, but keras-dist tune "
                    "--workers-per-trial > 1 runs each trial on a group of "
                    "workers. Use the keras_dist tuner of the same name "
                    "(same arguments): replace `keras_tuner.RandomSearch` with "
                    "`keras_dist.tuner.RandomSearch` (likewise Hyperband, "
                    "BayesianOptimization, GridSearch; for your own Tuner "
                    "subclass, add keras_dist.tuner.DistributedTuner as its "
                    "first base), or run with --workers-per-trial 1."
                )
                raise SystemExit(2)
            worker_overwrite(kwargs)
        init(self, *args, **kwargs)

    return __init__


def _prepare(role: str, in_group: bool) -> None:
    try:
        from keras_dist.tuner import _kt_compat as kt
    except ImportError:
        return  # the script fails on its own import of keras_tuner
    if role == "chief":
        from keras_dist.tuner import _oracle

        # A plain keras-tuner script's chief: keras-tuner's servicer, served
        # by our loop, which sees the end of the search within 0.2 s
        # (keras-tuner's sleeps 20 s at a time once told to stop). No worker
        # is reaped: plain keras-tuner workers send nothing while they train.
        kt.oracle_chief.start_server = _report_trials(_plain_server(_oracle.serve))
        _oracle.serve = _report_trials(_oracle.serve)
        kt.BaseTuner.__init__ = _prepare_chief(kt.BaseTuner.__init__)
    else:
        kt.oracle_client.OracleClient.__init__ = _with_secret(
            kt.oracle_client.OracleClient.__init__)
        kt.BaseTuner.__init__ = _prepare_worker(kt.BaseTuner.__init__, in_group)
        kt.BaseTuner.search = _quiet_after_search(kt.BaseTuner.search)
        kt.wrap_trial_runs(_active_in_trials)


def _with_secret(init):
    """Wraps keras-tuner's `OracleClient.__init__` (a plain keras-tuner
    worker's client): its calls carry the search's secret."""
    from keras_dist.tuner import _kt_compat as kt
    from keras_dist.tuner import _oracle

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.stub = kt.protos.get_service_grpc().OracleStub(
            _oracle.channel(_oracle.oracle_address()))

    return __init__


def _active_in_trials(run):
    """The launcher's hang clock runs inside trials only: between trials a
    worker may wait for the oracle as long as the search needs."""
    from keras_dist import _liveness

    _liveness.set_active(False)

    @functools.wraps(run)
    def run_trial(*args, **kwargs):
        _liveness.set_active(True)
        try:
            return run(*args, **kwargs)
        finally:
            _liveness.set_active(False)

    return run_trial


def _take_secret() -> None:
    try:
        from keras_dist.tuner import _oracle
    except ImportError:
        return  # no keras-tuner: the script fails on its own import of it
    _oracle.take_secret()


def main(argv: list[str]) -> None:
    module = argv[:1] == ["-m"]
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit(_USAGE)
    target, args = argv[0], argv[1:]
    role = "chief" if os.environ.get("KERASTUNER_TUNER_ID") == "chief" else "worker"
    _take_secret()
    _prepare(role, in_group=bool(os.environ.get("TF_CONFIG")))
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
