"""Multi-worker set-up that must happen before TensorFlow starts its runtime.

`MultiWorkerMirroredStrategy` configures TensorFlow's collective ops, which
TensorFlow accepts only before its runtime has started ("Collective ops must
be configured at program startup"). Users build layers on `keras.Input`
(which starts the runtime) before their first keras_dist call, so
`import keras_dist` does that configuration itself in every process that is
a task of a multi-worker job (`TF_CONFIG` with several training tasks, or a
Slurm step with several tasks). It also hands TensorFlow the task's server
definition, so that its runtime starts (at the script's first TensorFlow
call) with the job's device names: an input pipeline, a `Normalization`
layer adapted on data, tensors or variables made before the model keep
working once the strategy exists. It starts nothing itself: the strategy
is still created on first use, and devices (`simulate_replicas`, GPU memory
growth) can still be configured after the import.

The values are the ones `MultiWorkerMirroredStrategy.__init__` passes
(`tensorflow/python/distribute/collective_all_reduce_strategy.py`,
`_initialize_multi_worker`), so its own call finds them already set.
"""

from __future__ import annotations

import os

from keras_dist import _cluster

# Set by the launcher process itself (it trains nothing).
_DISABLE = "KERAS_DIST_NO_STARTUP"

configured = False


def is_multi_worker_task() -> bool:
    """True for a training task of a job with several (TF_CONFIG / Slurm)."""
    try:
        cluster = _cluster.parse_tf_config()
    except ValueError:
        return False  # reported, with the field named, by resolve_strategy
    if cluster is not None:
        return (
            cluster.num_workers > 1
            and cluster.task_type in ("chief", "worker")
            and not cluster.cluster.get("ps")
        )
    return _cluster.slurm_num_tasks() > 1


def configure_collectives() -> bool:
    """Configures collective ops for this task if it is a multi-worker task.

    Returns True if collectives are (now) configured. Does nothing (False)
    outside multi-worker jobs, in the launcher, or once TensorFlow's runtime
    has started (the strategy's creation then reports what to change).
    """
    global configured
    if configured:
        return True
    if os.environ.get(_DISABLE) or not is_multi_worker_task():
        return False
    import tensorflow as tf

    from keras_dist import _keras_compat

    if _keras_compat.eager_runtime_started():
        return False
    try:
        if _cluster.parse_tf_config() is not None:
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        else:
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        spec = resolver.cluster_spec()
        task_type, task_id = resolver.task_type, int(resolver.task_id)
    except (ValueError, RuntimeError, OSError, KeyError):
        return False  # left to the strategy's creation, which names the problem
    if not _keras_compat.configure_collectives(spec, task_type, task_id):
        return False
    # The runtime then starts as this task: a dataset, tensor or variable
    # the script makes before its model keeps working under the strategy.
    _keras_compat.join_cluster_at_startup(spec, task_type, task_id)
    configured = True
    return True
