"""keras_dist: train any Keras 3 model on many devices and machines.

The core: `DistributedModel` (and `distribute` for an existing model),
`resolve_strategy`, `simulate_replicas`, `describe` and `worker_info`; `average_loss`
for custom training loops; `launch` starts and
supervises the workers of a multi-worker job (also `keras-dist launch`),
`launch_search` those of a distributed keras-tuner search (`keras-dist
tune`, with `keras_dist.tuner`).
The `keras-dist` command (the launcher) starts without loading TensorFlow.
"""

import importlib as _importlib
import os as _os
import sys as _sys

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# In a task of a multi-worker job, configure TensorFlow's collective ops now,
# before the user's script builds layers (which starts TensorFlow's runtime).
# The launcher command itself trains nothing and does not import TensorFlow.
def _in_launcher() -> bool:
    """Whether this process is the `keras-dist` command (or `-m keras_dist.cli`)."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "").startswith("keras-dist"):
        return True
    argv = list(getattr(_sys, "orig_argv", []))
    return any(a == "-m" and b == "keras_dist.cli" for a, b in zip(argv, argv[1:]))


_IN_LAUNCHER = _in_launcher()
if not _IN_LAUNCHER:
    from keras_dist import _liveness as _liveness
    from keras_dist import _startup as _startup

    _liveness.start()  # only in a process started by keras-dist launch/tune
    _startup.configure_collectives()

__version__ = "0.1.0"

_EXPORTS = {
    "DistributedModel": "keras_dist.distributed_model",
    "SidecarEvaluator": "keras_dist.sidecar",
    "average_loss": "keras_dist.custom_loop",
    "describe": "keras_dist.strategy",
    "distribute": "keras_dist.distributed_model",
    "launch": "keras_dist.launchers.train",
    "launch_search": "keras_dist.launchers.search",
    "resolve_strategy": "keras_dist.strategy",
    "scale_learning_rate": "keras_dist.callbacks.learning_rate_scaler",
    "simulate_replicas": "keras_dist.strategy",
    "worker_info": "keras_dist.strategy",
}

__all__ = [
    "DistributedModel",
    "SidecarEvaluator",
    "average_loss",
    "describe",
    "distribute",
    "launch",
    "launch_search",
    "resolve_strategy",
    "scale_learning_rate",
    "simulate_replicas",
    "worker_info",
]


def __getattr__(name):
    if name in ("callbacks", "tuner"):
        return _importlib.import_module(f"keras_dist.{name}")
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))


if not _IN_LAUNCHER:
    # The model classes keras_dist saves under (DistributedFunctional, ...)
    # are registered with Keras now, so `keras.models.load_model` of a saved
    # keras_dist model works right after `import keras_dist`. Importing them
    # imports TensorFlow and Keras but starts nothing: `simulate_replicas`,
    # `keras_dist.dtensor.initialize` and device settings still work after.
    from keras_dist import distributed_model as _distributed_model  # noqa: F401
