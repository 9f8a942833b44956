"""TensorFlow's runtime in a task of a multi-worker job: collective ops
configured and the cluster joined before the runtime starts, and undone for
DTensor.
"""

from __future__ import annotations


def eager_runtime_started() -> bool:
    """Whether TensorFlow's eager runtime exists (collectives are fixed then)."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_collectives(cluster_spec, task_type: str, task_id: int) -> bool:
    """What `MultiWorkerMirroredStrategy.__init__` configures, done early.

    The values are the ones `_initialize_multi_worker` passes
    (`tensorflow/python/distribute/collective_all_reduce_strategy.py`), so
    the strategy's own call finds them already set. Returns False when the
    cluster spec is unusable (the strategy's creation reports it).
    """
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2,
    )
    from tensorflow.python.eager import context

    try:
        spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    except (ValueError, RuntimeError, KeyError):
        return False
    ctx = context.context()
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
            # TensorFlow's default (10 s) failed a 2-worker job once on a
            # 2-core machine under load: the leader's own heartbeat came
            # late. `keras-dist launch` watches its workers itself.
            heartbeat_timeout_in_ms=60_000,
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=spec.num_tasks(job)
                )
                for job in ("chief", "worker")
                if job in spec.jobs
            ],
        )
    return True


def join_cluster_at_startup(cluster_spec, task_type: str, task_id: int) -> None:
    """Makes TensorFlow's runtime start as this task of the cluster.

    `MultiWorkerMirroredStrategy.__init__` enables collective ops with a
    server definition (`_initialize_multi_worker`); when the runtime is
    already running, TensorFlow renames the local devices from
    `/job:localhost` to `/job:<task_type>` and every dataset, tensor or
    variable made before becomes unusable ("/job:localhost/... unknown
    device"). Given the same definition before the runtime starts, the
    runtime starts (at the script's first TensorFlow call, after any device
    configuration) with the job's device names, so objects made before the
    strategy keep working. The definition is the strategy's own: the
    context's configuration with `_update_config_proto`'s changes.
    """
    from tensorflow.core.protobuf import rewriter_config_pb2, tensorflow_server_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    ctx = context.context()
    config = ctx.config
    rewrite = config.graph_options.rewrite_options
    rewrite.scoped_allocator_optimization = rewriter_config_pb2.RewriterConfig.ON
    del rewrite.scoped_allocator_opts.enable_op[:]
    rewrite.scoped_allocator_opts.enable_op.append("CollectiveReduce")
    config.experimental.collective_group_leader = multi_worker_util.collective_leader(
        spec, task_type, task_id
    )
    del config.device_filters[:]
    config.device_filters.append(f"/job:{task_type}/task:{task_id}")
    ctx.enable_collective_ops(
        tensorflow_server_pb2.ServerDef(
            cluster=spec.as_cluster_def(),
            default_session_config=config,
            job_name=task_type,
            task_index=task_id,
            protocol="grpc",
        )
    )
    # This process's server is started (at its runtime's start): every
    # MultiWorkerMirroredStrategy made in it, keras_dist's or the user's
    # own, uses it as TensorFlow does for a strategy whose server already
    # started (`_std_server_started`), instead of updating it with a second
    # `enable_collective_ops`, which races with peers resolving their first
    # collective group (a 2-worker job was seen to hang in its first
    # broadcast). The Python health check stays off, as TensorFlow turns it
    # off whenever the coordination service (configured above) runs.
    from tensorflow.python.distribute import collective_all_reduce_strategy

    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    extended._std_server_started = True
    extended._enable_check_health = False


def forget_collectives() -> None:
    """Undoes `configure_collectives` before the runtime starts (a process
    that turns out to run multi-client DTensor, which configures its own)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx._collective_leader = None
    ctx._collective_scoped_allocator_enabled_ops = None
    ctx._collective_use_nccl_communication = None
    ctx._collective_device_filters = None
    ctx._coordination_service_config = None
    ctx._collective_ops_server_def = None  # join_cluster_at_startup
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    if "_std_server_started" in vars(extended):
        del extended._std_server_started
        extended._enable_check_health = True


def abort_collectives(message: str) -> None:
    """Makes the collectives this process waits in fail now, and every later
    one at once (`UnavailableError: <message>`): what TensorFlow's own
    health check does when a peer is down (keras_dist turns that check
    off: the launcher watches the workers)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


class KeyExists(Exception):
    """`set_key`: the key already holds a value (the store never overwrites)."""


def key_store_available() -> bool:
    """Whether this process has TensorFlow's coordination service (a
    multi-worker job's key-value store, served by its leader task)."""
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def set_key(key: str, value: str) -> None:
    """Stores `value` under `key` in the job's coordination service
    (about 1-2 ms on loopback); raises `KeyExists` if the key has a value."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        raise KeyExists(key) from None


def wait_for_key(key: str, timeout_s: float) -> str | None:
    """The value stored under `key`, waiting up to `timeout_s` for one
    (None then). Blocks in TensorFlow's runtime, not holding the GIL."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
        return None


INTERNALS = {
    "tensorflow.python.eager.context.Context": (
        "abort_collective_ops",
        "coordination_service",
        "get_config_key_value",
        "set_config_key_value",
    ),
    "tensorflow.python.eager.context.Context (source)": (
        "_context_handle",
        "_collective_ops_server_def",
        "configure_collective_ops",
        "configure_coordination_service",
        "enable_collective_ops",
    ),
    # join_cluster_at_startup builds the definition the strategy builds, and
    # marks its server started.
    "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended (source)": (
        "_enable_check_health",
        "_std_server_started",
        "_update_config_proto",
        "collective_group_leader",
        "device_filters",
        "scoped_allocator_opts",
    ),
    "tensorflow.python.distribute.multi_worker_util": (
        "collective_leader",
        "coordination_leader",
        "normalize_cluster_spec",
    ),
}
"""The private Keras/TF symbols this module uses, by owner (merged into
`keras_dist._keras_compat.INTERNALS`, which tests/test_keras_compat.py pins)."""
