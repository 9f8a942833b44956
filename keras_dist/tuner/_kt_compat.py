"""Every keras-tuner symbol keras_dist relies on, in one place.

Public paths where keras-tuner 1.4 has them; the rest are internals of its
distributed mode (the gRPC oracle service and client), which keras-tuner
does not export. `tests/tuner/test_kt_compat.py` pins each of them, so a
keras-tuner upgrade that moves one fails there, by name.
"""

from __future__ import annotations

# Public.
from keras_tuner import HyperParameters  # noqa: F401
from keras_tuner import synchronized  # noqa: F401
from keras_tuner.engine.base_tuner import BaseTuner  # noqa: F401
from keras_tuner.engine.trial import Trial  # noqa: F401
from keras_tuner.engine.trial import TrialStatus  # noqa: F401
from keras_tuner.engine.tuner import maybe_distribute  # noqa: F401

# Internal: keras-tuner's distributed mode has no public path.
from keras_tuner.src import protos  # noqa: F401
from keras_tuner.src.distribute import oracle_chief  # noqa: F401
from keras_tuner.src.distribute import oracle_client  # noqa: F401
from keras_tuner.src.distribute import utils as _distribute_utils
from keras_tuner.src.distribute.oracle_chief import OracleServicer  # noqa: F401
from keras_tuner.src.utils import load_json  # noqa: F401


def is_chief_oracle() -> bool:
    """This process serves the oracle (`KERASTUNER_TUNER_ID=chief`)."""
    return _distribute_utils.is_chief_oracle()


def has_chief_oracle() -> bool:
    """A distributed search is configured (`KERASTUNER_ORACLE_IP` set)."""
    return _distribute_utils.has_chief_oracle()


INTERNALS = {
    "keras_tuner.src.protos": ("get_service", "get_service_grpc"),
    "keras_tuner.src.distribute.oracle_chief": ("OracleServicer", "start_server"),
    "keras_tuner.src.distribute.oracle_client": ("OracleClient",),
    "keras_tuner.src.distribute.utils": ("is_chief_oracle", "has_chief_oracle"),
    "keras_tuner.src.utils": ("load_json",),
}
"""The internal modules and names above, for the test that pins them."""
