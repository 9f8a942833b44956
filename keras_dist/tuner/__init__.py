"""Distributed hyperparameter search with keras-tuner, each trial distributed.

`RandomSearch`, `BayesianOptimization`, `Hyperband` and `GridSearch` are
keras-tuner's tuners (same arguments) that run every trial under a
`tf.distribute` strategy (`strategy="auto"`, keyword-only) and, when started
by `keras-dist tune` (or `keras_dist.launch_search`), share one search
through keras-tuner's own gRPC oracle, with prompt shutdown, bounded
connection waits and dead-worker recovery. `DistributedTuner` is the mixin,
for your own `keras_tuner.Tuner` subclasses. `is_chief()` says whether this
process holds the search's results (for code after `search`).

Needs the `tuner` extra: `pip install "keras-dist[tuner]"`.
"""

try:
    import keras_tuner as _keras_tuner  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "keras_dist.tuner needs keras-tuner, which is not installed. Install "
        'the extra: pip install "keras-dist[tuner]"'
    ) from e

from keras_dist.tuner.distributed_tuner import DistributedTuner, is_chief
from keras_dist.tuner.tuners import (
    BayesianOptimization,
    GridSearch,
    Hyperband,
    RandomSearch,
)

__all__ = [
    "BayesianOptimization",
    "DistributedTuner",
    "GridSearch",
    "Hyperband",
    "RandomSearch",
    "is_chief",
]
