"""Every keras-tuner symbol keras_dist relies on, in one place.

Public paths where keras-tuner 1.4 has them; the rest are internals of its
distributed mode (the gRPC oracle service and client), which keras-tuner
does not export. `tests/tuner/test_kt_compat.py` pins each of them, so a
keras-tuner upgrade that moves one fails there, by name.
"""

from __future__ import annotations

# Public.
import numpy as np
from keras_tuner import (
    HyperParameters,  # noqa: F401
    synchronized,  # noqa: F401
)
from keras_tuner.engine.base_tuner import BaseTuner  # noqa: F401
from keras_tuner.engine.trial import (
    Trial,  # noqa: F401
    TrialStatus,  # noqa: F401
)
from keras_tuner.engine.tuner import maybe_distribute  # noqa: F401
from keras_tuner.oracles import BayesianOptimizationOracle

# Internal: keras-tuner's distributed mode has no public path.
from keras_tuner.src import protos  # noqa: F401
from keras_tuner.src.distribute import (
    oracle_chief,  # noqa: F401
    oracle_client,  # noqa: F401
)
from keras_tuner.src.distribute import utils as _distribute_utils
from keras_tuner.src.distribute.oracle_chief import OracleServicer  # noqa: F401
from keras_tuner.src.utils import load_json  # noqa: F401


def is_chief_oracle() -> bool:
    """This process serves the oracle (`KERASTUNER_TUNER_ID=chief`)."""
    return _distribute_utils.is_chief_oracle()


def has_chief_oracle() -> bool:
    """A distributed search is configured (`KERASTUNER_ORACLE_IP` set)."""
    return _distribute_utils.has_chief_oracle()


def run_trial(tuner, trial, *fit_args, **fit_kwargs):
    """`BaseTuner._try_run_and_update_trial`: one trial, its status recorded."""
    return tuner._try_run_and_update_trial(trial, *fit_args, **fit_kwargs)


def wrap_trial_runs(wrap) -> None:
    """Wraps `BaseTuner._try_run_and_update_trial` for every tuner (`keras-dist tune`)."""
    BaseTuner._try_run_and_update_trial = wrap(BaseTuner._try_run_and_update_trial)


def build_hypermodel(tuner, hp):
    """keras-tuner's `Tuner._build_hypermodel` (builds, and wraps in its scope)."""
    from keras_tuner import Tuner

    return Tuner._build_hypermodel(tuner, hp)


def build_config_path(tuner, trial_id: str) -> str:
    return tuner._get_build_config_fname(trial_id)


def checkpoint_path(tuner, trial_id: str) -> str:
    return tuner._get_checkpoint_fname(trial_id)


def tensorboard_dir(tuner, log_dir: str, trial_id: str, execution: int) -> str:
    return tuner._get_tensorboard_dir(log_dir, trial_id, execution)


def retry_queue(oracle) -> list:
    """The ids of failed trials an oracle will hand out again (mutable)."""
    return oracle._retry_queue


def oracle_stub(client):
    """The gRPC stub inside keras-tuner's `OracleClient`."""
    return client._oracle


def honour_seed_zero(oracle, seed) -> None:
    """Makes a tuner's `seed=0` a seed, as it is everywhere else in Python.

    keras-tuner's `Oracle` keeps `seed or random.randint(1, 10000)`, so
    `seed=0` drew other hyperparameters on every run. An oracle that has
    drawn trials already (a resumed search) keeps the seed it ran with.
    """
    if seed != 0 or getattr(oracle, "seed", 0) == 0 or oracle.trials:
        return
    oracle.seed = 0
    oracle._seed_state = 0
    if isinstance(oracle, BayesianOptimizationOracle):
        oracle._random_state = np.random.RandomState(0)
        oracle.gpr = oracle._make_gpr()


OVERRIDDEN = {
    "_build_hypermodel": ("keras_tuner.Tuner",),
    "_configure_tensorboard_dir": ("keras_tuner.Tuner",),
    "_populate_initial_space": ("keras_tuner.engine.base_tuner.BaseTuner",),
    "_try_build": ("keras_tuner.Tuner",),
}
"""Private keras-tuner methods keras_dist's tuners override (name: owners)."""

INTERNALS = {
    "keras_tuner.src.protos": ("get_service", "get_service_grpc"),
    "keras_tuner.src.distribute.oracle_chief": ("OracleServicer", "start_server"),
    "keras_tuner.src.distribute.oracle_client": ("OracleClient",),
    "keras_tuner.src.distribute.utils": ("is_chief_oracle", "has_chief_oracle"),
    "keras_tuner.src.utils": ("load_json",),
}
"""The internal modules and names above, for the test that pins them."""

ATTRIBUTES = {
    "keras_tuner.oracles.RandomSearchOracle": ("seed", "_seed_state"),
    "keras_tuner.oracles.BayesianOptimizationOracle": (
        "seed", "_seed_state", "_random_state", "gpr", "_make_gpr",
    ),
}
"""Private oracle attributes `honour_seed_zero` sets (owner: names); they
exist on an instance only, so the pin test makes one."""
