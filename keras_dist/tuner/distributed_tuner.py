"""`DistributedTuner`: a keras-tuner tuner whose trials are distributed."""

from __future__ import annotations

import importlib.util
import inspect
import os

import numpy as np

from keras_dist import _collectives
from keras_dist._checks import check_seconds
from keras_dist.strategy import StrategySpec, resolve_strategy, worker_info
from keras_dist.tuner import _kt_compat as kt
from keras_dist.tuner import _oracle

# Statuses a trial handed out by `create_trial` can have, for the broadcast
# inside a multi-worker trial group.
_STATUSES = (
    kt.TrialStatus.RUNNING,
    kt.TrialStatus.IDLE,
    kt.TrialStatus.STOPPED,
)
_CODE_LENGTH = 64


def _argument(function, name: str, args: tuple, kwargs: dict):
    """The value `name` receives in a call `function(*args, **kwargs)`."""
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get(name)
    return bound.arguments.get(name, bound.arguments.get("kwargs", {}).get(name))


class DistributedTuner:
    """Mixin: a keras-tuner `Tuner` whose every trial runs on a strategy.

    Put it first in the bases of a keras-tuner tuner
    (`class MySearch(DistributedTuner, keras_tuner.RandomSearch)`);
    `keras_dist.tuner.RandomSearch` and friends are made this way. The
    tuner keeps every keras-tuner argument; the keyword-only arguments
    below are added.

    Each trial's model is built under the strategy (a plain Keras model is
    converted with `keras_dist.distribute`), so `fit` in a trial is
    `DistributedModel.fit`: correct on every strategy, and
    `LearningRateScaler`/`PerReplicaMetrics` apply per trial. keras-tuner's
    first build (search-space discovery) also runs under the strategy.

    In distributed search (the `KERASTUNER_*` variables, which
    `keras-dist tune` sets) the process whose `KERASTUNER_TUNER_ID` contains
    "chief" serves keras-tuner's gRPC oracle and trains nothing; it returns
    from `search` as soon as the last worker is told to stop. A tuner
    worker silent for `worker_timeout` seconds (dead, or cut off) has its
    trial ended as invalid (keras-tuner retries it up to
    `max_retries_per_trial` times, else marks it failed) and is forgotten.
    Workers sharing one `KERASTUNER_TUNER_ID` and one `TF_CONFIG` cluster
    form one `MultiWorkerMirroredStrategy` that runs one trial at a time:
    the group's chief asks the oracle for the trial and broadcasts it to
    the group with a collective, and only the group's chief reports.

    Works whether or not the `tensorboard` package is installed (without
    it, `TensorBoard` callbacks still get per-trial log directories, but no
    HParams summary).

    Args:
        strategy: The strategy every trial runs on: a `tf.distribute.Strategy`
            or a name for `keras_dist.resolve_strategy` (default `"auto"`).
            Replaces keras-tuner's `distribution_strategy`. Unused on the
            chief.
        connect_timeout: Seconds a tuner worker waits for the chief's oracle
            to be reachable before raising `ConnectionError` (default 120).
        call_timeout: Deadline in seconds of each call to the oracle
            (default 600; keras-tuner's is one hour).
        heartbeat_interval: Seconds between a worker's signs of life while
            a trial runs (default 5).
        worker_timeout: Seconds of silence after which the chief gives a
            worker's trial up (default 60). Must exceed twice
            `heartbeat_interval`.

    Example:

        ```python
        class MySearch(keras_dist.tuner.DistributedTuner, keras_tuner.Hyperband):
            pass

        tuner = MySearch(build_model, objective="val_accuracy", max_epochs=10,
                         strategy="mirrored")
        tuner.search(x, y, validation_split=0.2)
        ```

    Raises:
        ValueError: `distribution_strategy` is given (use `strategy`), or a
            timeout or interval is not a positive number, or
            `worker_timeout <= 2 * heartbeat_interval`.
        ConnectionError: a tuner worker could not reach the oracle within
            `connect_timeout`.
    """

    def __init__(
        self,
        *args,
        strategy: StrategySpec = "auto",
        connect_timeout: float = 120.0,
        call_timeout: float = 600.0,
        heartbeat_interval: float = 5.0,
        worker_timeout: float = 60.0,
        **kwargs,
    ):
        if kwargs.get("distribution_strategy") is not None:
            raise ValueError(
                "keras_dist.tuner tuners take `strategy=`, not "
                "`distribution_strategy=`. Received: distribution_strategy="
                f"{kwargs['distribution_strategy']!r}. Pass "
                "strategy=<the same strategy> instead."
            )
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("call_timeout", call_timeout),
            ("heartbeat_interval", heartbeat_interval),
            ("worker_timeout", worker_timeout),
        ):
            check_seconds(name, value)
        if worker_timeout <= 2 * heartbeat_interval:
            raise ValueError(
                "Invalid value for argument `worker_timeout`. Expected more "
                "than twice `heartbeat_interval`, so that a live worker is "
                f"never given up. Received: worker_timeout={worker_timeout!r}, "
                f"heartbeat_interval={heartbeat_interval!r}"
            )
        self._client_timeouts = (
            float(connect_timeout),
            float(call_timeout),
            float(heartbeat_interval),
        )
        self._tuner_worker_timeout = float(worker_timeout)
        # The chief only serves the oracle: it does not touch devices.
        chief = kt.is_chief_oracle()
        self._trial_strategy = None if chief else resolve_strategy(strategy)
        info = None if chief else worker_info(self._trial_strategy)
        self._in_trial_group = info is not None and info.num_workers > 1
        self._is_group_chief = info is None or info.is_chief
        self._broadcast_function = None
        kwargs["distribution_strategy"] = self._trial_strategy
        if kt.has_chief_oracle() and not chief:
            worker_overwrite(kwargs)
        seed = _argument(super().__init__, "seed", args, kwargs)
        super().__init__(*args, **kwargs)
        kt.honour_seed_zero(self.oracle, seed)
        if isinstance(self.oracle, kt.oracle_client.OracleClient):
            connect, call, beat = self._client_timeouts
            client = _oracle.Client(
                kt.oracle_stub(self.oracle),
                connect_timeout=connect,
                call_timeout=call,
                heartbeat_interval=beat,
            )
            client.multi_worker = self.oracle.multi_worker
            client.should_report = self.oracle.should_report
            self.oracle = client

    # -- building ----------------------------------------------------------

    def _populate_initial_space(self):
        with kt.maybe_distribute(self._trial_strategy):
            super()._populate_initial_space()

    def _try_build(self, hp):
        from keras_dist.distributed_model import DistributedModel, distribute

        model = super()._try_build(hp)
        if self._trial_strategy is not None and not isinstance(model, DistributedModel):
            model = distribute(model, self._trial_strategy)
        return model

    def load_model(self, trial):
        # keras-tuner's, with the optimizer built first: the checkpoint holds
        # its slots, which Keras otherwise skips with a warning.
        model = self._try_build(trial.hyperparameters)
        with kt.maybe_distribute(self._trial_strategy):
            if not model.built:
                model.build_from_config(
                    kt.load_json(kt.build_config_path(self, trial.trial_id))
                )
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            model.load_weights(kt.checkpoint_path(self, trial.trial_id))
        return model

    def _configure_tensorboard_dir(self, callbacks, trial, execution=0):
        if importlib.util.find_spec("tensorboard") is not None:
            return super()._configure_tensorboard_dir(callbacks, trial, execution)
        # keras-tuner imports tensorboard here on every trial; without it,
        # keep its per-trial log directories and leave out the HParams
        # summary (which needs the package).
        for callback in callbacks:
            if callback.__class__.__name__ == "TensorBoard":
                callback.log_dir = kt.tensorboard_dir(
                    self, callback.log_dir, trial.trial_id, execution
                )
        return None

    # -- the search --------------------------------------------------------

    def search(self, *fit_args, **fit_kwargs):
        """keras-tuner's `search`; on the chief, serves the oracle."""
        if kt.is_chief_oracle():
            if "verbose" in fit_kwargs:
                self.oracle.verbose = fit_kwargs["verbose"]
            self.save()
            _oracle.serve(self.oracle, worker_timeout=self._tuner_worker_timeout)
            return None
        if not self._in_trial_group:
            return super().search(*fit_args, **fit_kwargs)
        # A multi-worker trial group: one trial at a time, agreed by
        # collective (keras-tuner's loop would let a member that is not the
        # group's chief pick up the trial it has just finished).
        self.on_search_begin()
        while True:
            self.pre_create_trial()
            trial = self._agreed_trial()
            if trial.status == kt.TrialStatus.STOPPED:
                break
            if trial.status == kt.TrialStatus.IDLE:
                continue
            self.on_trial_begin(trial)
            kt.run_trial(self, trial, *fit_args, **fit_kwargs)
            self.on_trial_end(trial)
        self.on_search_end()
        return None

    def on_trial_begin(self, trial):
        super().on_trial_begin(trial)
        if isinstance(self.oracle, _oracle.Client) and self.oracle.should_report:
            self.oracle.start_heartbeat(trial.trial_id)

    def on_trial_end(self, trial):
        if isinstance(self.oracle, _oracle.Client):
            self.oracle.stop_heartbeat()
        super().on_trial_end(trial)

    def save(self):
        # Members of a trial group share a tuner id (and a state file): the
        # group's chief writes it.
        if self._is_group_chief:
            super().save()

    def _agreed_trial(self):
        if self._is_group_chief:
            trial = self.oracle.create_trial(self.tuner_id)
            code = _encode(trial)
        else:
            trial, code = None, np.zeros([_CODE_LENGTH], np.float32)
        status, trial_id = _decode(self._broadcast_code(code))
        if trial is not None:
            return trial
        if status == kt.TrialStatus.RUNNING:
            return self.oracle.get_trial(trial_id)
        return kt.Trial(kt.HyperParameters(), status=status)

    def _broadcast_code(self, code):
        if self._broadcast_function is None:
            self._broadcast_function = _collectives.broadcast_from_chief(
                self._trial_strategy
            )
        return self._broadcast_function(code)


def _encode(trial) -> np.ndarray:
    code = np.zeros([_CODE_LENGTH], np.float32)
    code[0] = _STATUSES.index(trial.status) + 1
    if trial.status == kt.TrialStatus.RUNNING:
        chars = [ord(c) for c in trial.trial_id]
        if len(chars) > _CODE_LENGTH - 2:
            raise ValueError(f"trial id too long to broadcast: {trial.trial_id!r}")
        code[1] = len(chars)
        code[2 : 2 + len(chars)] = chars
    return code


def _decode(code) -> tuple[str, str | None]:
    status = _STATUSES[int(round(float(code[0]))) - 1]
    if status != kt.TrialStatus.RUNNING:
        return status, None
    length = int(round(float(code[1])))
    return status, "".join(chr(int(round(float(c)))) for c in code[2 : 2 + length])


def is_chief() -> bool:
    """Whether this process holds the whole search's results.

    `keras-dist tune` runs the search script in every process: the chief
    (which serves the oracle) and the tuner workers. Code after `search`
    that reports or saves the results belongs on the chief. A search run
    without `keras-dist tune` (one process) is its own chief.

    Returns:
        True on the chief of a distributed search and in a search run
        alone; False in a tuner worker.

    Example:

        >>> from keras_dist import tuner
        >>> tuner.is_chief()  # a process not started by keras-dist tune
        True
    """
    return os.environ.get("KERASTUNER_TUNER_ID", "chief") == "chief"


def worker_overwrite(kwargs: dict) -> None:
    """A tuner worker's `overwrite=True` (in the tuner's keyword arguments).

    The chief owns the project directory: `overwrite=True` on a worker would
    delete the chief's oracle state and the other workers' trials while they
    use them. A worker only starts its own state afresh.
    """
    if kwargs.get("overwrite", False):
        own = os.path.join(
            str(kwargs.get("directory") or "."),
            str(kwargs.get("project_name") or "untitled_project"),
            f"{os.environ['KERASTUNER_TUNER_ID']}.json",
        )
        if os.path.exists(own):
            os.remove(own)
    kwargs["overwrite"] = False
