"""Multi-worker set-up that must happen before TensorFlow starts its runtime.

`MultiWorkerMirroredStrategy` configures TensorFlow's collective ops, which
TensorFlow accepts only before its runtime has started ("Collective ops must
be configured at program startup"). Users build layers on `keras.Input`
(which starts the runtime) before their first keras_dist call, so
`import keras_dist` does that configuration itself in every process that is
a task of a multi-worker job (`TF_CONFIG` with several training tasks, or a
Slurm step with several tasks). It starts nothing: the strategy itself is
still created on first use, and devices (`simulate_replicas`, GPU memory
growth) can still be configured after the import.

The values are the ones `MultiWorkerMirroredStrategy.__init__` passes
(`tensorflow/python/distribute/collective_all_reduce_strategy.py`,
`_initialize_multi_worker`), so its own call finds them already set.
"""

from __future__ import annotations

import os

from keras_dist import _tf_config

# Set by the launcher process itself (it trains nothing).
_DISABLE = "KERAS_DIST_NO_STARTUP"

configured = False


def is_multi_worker_task() -> bool:
    """True for a training task of a job with several (TF_CONFIG / Slurm)."""
    try:
        cluster = _tf_config.parse_tf_config()
    except ValueError:
        return False  # reported, with the field named, by resolve_strategy
    if cluster is not None:
        return (
            cluster.num_workers > 1
            and cluster.task_type in ("chief", "worker")
            and not cluster.cluster.get("ps")
        )
    return _tf_config.slurm_num_tasks() > 1


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
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2,
    )
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._context_handle is not None:  # runtime already started
        return False
    try:
        if _tf_config.parse_tf_config() is not None:
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        else:
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
        task_type, task_id = resolver.task_type, int(resolver.task_id)
    except (ValueError, RuntimeError, OSError, KeyError):
        return False  # left to the strategy's creation, which names the problem
    ctx.configure_collective_ops(
        collective_leader=multi_worker_util.collective_leader(
            spec, task_type, task_id
        ),
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{task_type}/task:{task_id}",),
    )
    if ctx.coordination_service is None and task_type in ("chief", "worker"):
        ctx.configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(spec),
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=spec.num_tasks(job)
                )
                for job in ("chief", "worker")
                if job in spec.jobs
            ],
        )
    configured = True
    return True
