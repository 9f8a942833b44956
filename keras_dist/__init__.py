"""keras_dist: train any Keras 3 model on many devices and machines.

The core: `DistributedModel` (and `distribute` for an existing model),
`resolve_strategy`, `simulate_replicas` and `describe`.
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_dist.distributed_model import DistributedModel  # noqa: E402
from keras_dist.distributed_model import distribute  # noqa: E402
from keras_dist.strategy import describe  # noqa: E402
from keras_dist.strategy import resolve_strategy  # noqa: E402
from keras_dist.strategy import simulate_replicas  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DistributedModel",
    "describe",
    "distribute",
    "resolve_strategy",
    "simulate_replicas",
]
