"""Picking, creating and describing the `tf.distribute.Strategy` to train on.

`resolve_strategy` is the single place where keras_dist turns a user's request
("auto", "mirrored", a ready strategy, ...) into a strategy object. It caches
what it creates, so the same request returns the same object for the whole
process, and it gives every `MirroredStrategy` over a new device set its own
collective key range, so that strategies with different replica counts can
live in one process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal, Union

import tensorflow as tf

from keras_dist import _cluster, _keras_compat, _liveness
from keras_dist._cluster import LAUNCHED_ENV

StrategySpec = Union[
    Literal["auto", "mirrored", "multi_worker", "tpu", "default"],
    tf.distribute.Strategy,
]

_SPECS = ("auto", "mirrored", "multi_worker", "tpu", "default")
_TPU_ENV_HINTS = ("TPU_NAME", "COLAB_TPU_ADDR", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS")
# Collective group keys of the strategies keras_dist creates start at
# `_KEY_STRIDE * k` (k >= 1), away from TF's default range that starts at 1.
_KEY_STRIDE = 100_000

_lock = threading.RLock()
_cache: dict[tuple, tf.distribute.Strategy] = {}
# More logical CPUs than this take TensorFlow minutes to set up (a strategy
# over 1024 took 6.5 s here, growing faster than the count), and stand for
# no host: a machine has at most a few dozen accelerators.
MAX_SIMULATED_REPLICAS = 1024
_mirrored_key_bases: dict[tuple, int] = {}
_communication: dict[tuple, object] = {}  # the options each strategy was made with


def simulate_replicas(num_replicas: int) -> int:
    """Splits the host CPU into `num_replicas` logical devices.

    With it a laptop or a CI runner trains on real replicas: `"auto"`
    resolves to a `MirroredStrategy` over the logical CPUs, and collectives
    run as they would across GPUs. It must run before TensorFlow initializes
    its devices (before the first op, model or strategy); calling it again
    with the same count is harmless.

    Args:
        num_replicas: Integer from 1 to 1024, the number of logical CPUs
            to create.

    Returns:
        The number of logical CPU devices now configured.

    Example:

        >>> import keras_dist
        >>> keras_dist.simulate_replicas(2)  # doctest: +SKIP
        2

    Raises:
        TypeError: if `num_replicas` is not an integer.
        ValueError: if `num_replicas` is not in 1..1024.
        RuntimeError: if TensorFlow has already initialized its devices with
            another configuration.
    """
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool):
        raise TypeError(
            "Invalid type for argument `num_replicas`. Expected a positive "
            f"integer. Received: num_replicas={num_replicas!r} of type "
            f"{type(num_replicas).__name__}."
        )
    if not 1 <= num_replicas <= MAX_SIMULATED_REPLICAS:
        raise ValueError(
            "Invalid value for argument `num_replicas`. Expected an integer "
            f"from 1 to {MAX_SIMULATED_REPLICAS}. Received: num_replicas="
            f"{num_replicas}. Use 1 for a single device, 2 or more (as many "
            "as the machines you plan for have devices) to simulate replicas."
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_replicas:
        return num_replicas
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_replicas
        )
    except RuntimeError as e:
        have = len(current) if current else 1
        raise RuntimeError(
            f"simulate_replicas({num_replicas}) was called after TensorFlow "
            f"initialized its devices (it has {have} CPU device(s) now). "
            "Call keras_dist.simulate_replicas() at the very top of your "
            "program, before creating any tensor, model or strategy. "
            f"TensorFlow said: {e}"
        ) from None
    return num_replicas


CommunicationSpec = Union[
    Literal["auto", "ring", "nccl"], tf.distribute.experimental.CommunicationOptions, None
]
_COMMUNICATIONS = ("auto", "ring", "nccl")
# `CommunicationOptions(...)` returns an object of another (internal) class.
_OPTIONS_TYPE = type(tf.distribute.experimental.CommunicationOptions())


def resolve_strategy(
    spec: StrategySpec = "auto", *, communication: CommunicationSpec = None
) -> tf.distribute.Strategy:
    """Returns the `tf.distribute.Strategy` that a request names.

    `"auto"` picks, in order: the strategy whose scope is open; a
    `TPUStrategy` when a TPU is reachable (`TPU_NAME` or a TPU VM); a
    `MultiWorkerMirroredStrategy` when `TF_CONFIG` lists more than one task or
    the Slurm job step has several tasks; a `MirroredStrategy` when there are
    2+ GPUs, or 2+ logical CPUs (see `simulate_replicas`); else the default
    strategy. Explicit names force one kind. The same request returns the
    same object for the whole process.

    Args:
        spec: One of `"auto"` (default), `"mirrored"`, `"multi_worker"`,
            `"tpu"`, `"default"`, or a ready `tf.distribute.Strategy` (which is
            returned as is).
        communication: How a `MultiWorkerMirroredStrategy` all-reduces
            gradients: `"auto"` (the default, also for None): NCCL when the
            workers have GPUs, ring (gRPC) on CPUs; `"ring"`; `"nccl"`; or a
            `tf.distribute.experimental.CommunicationOptions` (to also set
            `bytes_per_pack`, which splits the gradients into packs of that
            many bytes so that the all-reduce of the first pack overlaps the
            rest; 0, the default, sends them all in one). Only a multi-worker
            strategy uses it; it applies when the strategy is created (once
            per process), and a later request for other options is refused.

    Returns:
        A `tf.distribute.Strategy`.

    Example:

        >>> import keras_dist
        >>> strategy = keras_dist.resolve_strategy("default")
        >>> strategy.num_replicas_in_sync
        1

    Raises:
        TypeError: if `spec` is neither a string nor a strategy, or
            `communication` is not one of the accepted kinds.
        ValueError: for an unknown name, a malformed `TF_CONFIG`, or
            `communication` options other than those of the multi-worker
            strategy this process already created.
        RuntimeError: if `"tpu"` is requested and no TPU can be reached.
    """
    options = _communication_options(communication)
    if isinstance(spec, tf.distribute.Strategy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            "Invalid type for argument `strategy`. Expected one of "
            f"{_SPECS} or a tf.distribute.Strategy. Received: "
            f"strategy={spec!r} of type {type(spec).__name__}."
        )
    if spec not in _SPECS:
        raise ValueError(
            "Invalid value for argument `strategy`. Expected one of "
            f"{_SPECS} or a tf.distribute.Strategy. Received: "
            f"strategy={spec!r}."
        )
    with _lock:
        if spec == "auto":
            return _resolve_auto(options)
        if spec == "default":
            return _default_strategy()
        if spec == "multi_worker":
            return _multi_worker(options)
        if spec == "tpu":
            strategy = _tpu(required=True)
            return strategy
        _refuse_local_strategy_in_a_job(spec)
        return _mirrored(_local_devices())


def _refuse_local_strategy_in_a_job(spec: str) -> None:
    """A strategy over this process's devices alone, in a task of a
    multi-worker job, is refused before it is made.

    The task's runtime started as part of the job (see `_startup`): it
    resolves every collective group with the job's leader, so a group of
    this process's replicas alone meets the other workers' groups there and
    its first step fails or waits forever. It would also train a model of
    its own, apart from the job's.
    """
    from keras_dist import _startup

    if _startup.configured:
        raise ValueError(
            f"Invalid value for argument `strategy`: {spec!r} spans this "
            "process's devices only, but this process is a task of a "
            "multi-worker job (TF_CONFIG, Slurm or keras-dist launch) and "
            f"TensorFlow started as part of it. Received: strategy={spec!r}. "
            "Use strategy='auto' (or 'multi_worker') to train with the "
            "other workers, or run the script without the job's TF_CONFIG."
        )


def _default_strategy() -> tf.distribute.Strategy:
    # The default strategy is a process-wide singleton; read it where no
    # other strategy's scope is open (a fresh thread, if one is open here).
    if ("default",) in _cache:
        return _cache[("default",)]
    if not tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    else:
        result = []
        thread = threading.Thread(
            target=lambda: result.append(tf.distribute.get_strategy())
        )
        thread.start()
        thread.join()
        strategy = result[0]
    _cache[("default",)] = strategy
    return strategy


def is_default(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy` is TensorFlow's default (no-op) strategy."""
    return strategy is _default_strategy()


def _communication_options(communication: CommunicationSpec):
    """The `CommunicationOptions` a `communication=` request names (None: default)."""
    if communication is None or isinstance(communication, _OPTIONS_TYPE):
        return communication
    if not isinstance(communication, str) or communication not in _COMMUNICATIONS:
        kind = "value" if isinstance(communication, str) else "type"
        error = ValueError if isinstance(communication, str) else TypeError
        raise error(
            f"Invalid {kind} for argument `communication`. Expected one of "
            f"{_COMMUNICATIONS}, None or a "
            "tf.distribute.experimental.CommunicationOptions. Received: "
            f"communication={communication!r}."
        )
    gpus = bool(tf.config.list_physical_devices("GPU"))
    if communication == "nccl" and not gpus:
        raise ValueError(
            "Invalid value for argument `communication`: NCCL all-reduces "
            "between GPUs, and this process sees none. Received: "
            "communication='nccl'. Use communication='ring' (or 'auto') on CPUs."
        )
    if communication == "auto":
        # Explicit per platform: NCCL between GPUs, ring (gRPC) between CPUs.
        communication = "nccl" if gpus else "ring"
    implementations = tf.distribute.experimental.CommunicationImplementation
    return tf.distribute.experimental.CommunicationOptions(
        implementation=implementations.NCCL
        if communication == "nccl"
        else implementations.RING
    )


def _options_key(options) -> tuple:
    if options is None:
        options = _communication_options("auto")
    return (options.implementation, options.bytes_per_pack, options.timeout_seconds)


def _resolve_auto(options=None) -> tf.distribute.Strategy:
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    # Decide from the environment first: MultiWorkerMirroredStrategy must be
    # created before TensorFlow initializes its runtime.
    cluster = _cluster.parse_tf_config()
    if any(os.environ.get(name) for name in _TPU_ENV_HINTS) or (
        os.path.exists("/dev/accel0") and cluster is None
    ):
        strategy = _tpu(required=False)
        if strategy is not None:
            return strategy
    # A job's evaluator trains nothing: it evaluates on its own devices,
    # outside the training cluster (the local choice below).
    evaluator = cluster is not None and cluster.task_type == "evaluator"
    if cluster is not None and cluster.num_workers > 1 and not evaluator:
        return _multi_worker(options)
    if cluster is None and _cluster.slurm_num_tasks() > 1:
        return _multi_worker(options)
    devices = _local_devices()
    if len(devices) > 1:
        return _mirrored(devices)
    return tf.distribute.get_strategy()


def _local_devices() -> tuple[str, ...]:
    """GPUs if any, else the logical CPUs, without initializing TF."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        logical = tf.config.list_logical_devices("GPU")
        return tuple(d.name for d in logical)
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    count = len(configured) if configured else 1
    return tuple(f"/device:CPU:{i}" for i in range(count))


def _mirrored(devices: tuple[str, ...]) -> tf.distribute.Strategy:
    key = ("mirrored", devices)
    if key not in _cache:
        # TF starts the collective group keys of every MirroredStrategy at 1,
        # so two strategies over different device sets collide in one
        # process. Give each device set its own key range.
        base = _mirrored_key_bases.setdefault(
            devices, _KEY_STRIDE * (len(_mirrored_key_bases) + 1)
        )
        _cache[key] = _keras_compat.mirrored_strategy(devices, base)
    return _cache[key]


def _multi_worker(options=None) -> tf.distribute.Strategy:
    key = ("multi_worker",)
    if key in _cache:
        created = _options_key(_communication[key])
        if options is not None and _options_key(options) != created:
            raise ValueError(
                "Invalid value for argument `communication`: this process "
                "already created its MultiWorkerMirroredStrategy with "
                f"implementation={created[0].name}, bytes_per_pack={created[1]} "
                "(a process can create only one). Received: "
                f"implementation={options.implementation.name}, "
                f"bytes_per_pack={options.bytes_per_pack}. Pass the same "
                "options, or None, in every resolve_strategy call."
            )
    if key not in _cache:
        options = options or _communication_options("auto")
        cluster = _cluster.parse_tf_config()
        if cluster is None and _cluster.slurm_num_tasks() > 1:
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        else:
            resolver = None
        started = time.monotonic()
        _liveness.joining()
        try:
            _cache[key] = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver, communication_options=options
            )
            _communication[key] = options
        except RuntimeError as e:
            if "program startup" not in str(e):
                raise
            raise RuntimeError(
                "MultiWorkerMirroredStrategy could not be created: TensorFlow "
                "had already started (an op ran, or a layer was built) before "
                "keras_dist was imported, and collective ops can only be "
                "configured before that. Put `import keras_dist` before the "
                "first TensorFlow or Keras call of the script (keras_dist then "
                "configures them at import), or create the strategy first. "
                f"TensorFlow said: {e}"
            ) from None
        _liveness.joined()
        if os.environ.get(LAUNCHED_ENV):
            # A progress line for the launcher's console (shown even when
            # the workers' output goes to log files).
            sys.stderr.write(
                f"[keras-dist] cluster formed in {time.monotonic() - started:.1f}s: "
                f"{describe(_cache[key])}\n"
            )
            sys.stderr.flush()
    return _cache[key]


def _tpu(required: bool) -> tf.distribute.Strategy | None:
    key = ("tpu",)
    if key in _cache:
        return _cache[key]
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=os.environ.get("TPU_NAME", "")
        )
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        strategy = tf.distribute.TPUStrategy(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        if required:
            raise RuntimeError(
                'strategy="tpu" was requested but no TPU could be reached '
                f"({type(e).__name__}: {e}). Set TPU_NAME to your TPU's name "
                "or address, run on a TPU VM, or use strategy=\"auto\"."
            ) from e
        return None
    _cache[key] = strategy
    return strategy


@dataclass(frozen=True)
class WorkerInfo:
    """This process's place in a job: `num_workers`, `rank`, `is_chief`,
    `task_type` (`"evaluator"` for a job's evaluator task, which trains
    nothing: `rank` -1, not chief)."""

    num_workers: int
    rank: int
    is_chief: bool
    task_type: str = "worker"  # TF_CONFIG's task type ("worker" without one)


def worker_info(strategy: StrategySpec | None = None) -> WorkerInfo:
    """This process's place among the workers of `strategy`.

    For what only one worker of a multi-worker job should do: print, write
    files of your own, upload. (keras_dist's `save`/`save_weights` and its
    callbacks already write on the chief only: call them on every worker.)
    In a single-process run it is `WorkerInfo(num_workers=1, rank=0,
    is_chief=True)`. The evaluator task of a job whose `TF_CONFIG` has one
    (Vertex AI, SageMaker, Kubeflow's TFJob) gets `rank=-1`,
    `is_chief=False`, `task_type="evaluator"`: it trains nothing (see
    docs/launch.md, "Managed jobs").

    Args:
        strategy: A strategy or a spec for `resolve_strategy` (e.g. a
            model's `model.distribute_strategy`); defaults to the strategy
            in scope, else to the job's cluster as `TF_CONFIG` (or Slurm)
            describes it, so that the top of a script, before any strategy
            exists, already knows which worker it is.

    Returns:
        A `WorkerInfo` with `num_workers` (the training tasks), `rank`
        (0-based, the chief first), `is_chief` and `task_type` (the
        `TF_CONFIG` task type; `"worker"` without one).

    Example:

        >>> import keras_dist
        >>> info = keras_dist.worker_info("default")
        >>> if info.is_chief:
        ...     print(f"worker {info.rank} of {info.num_workers}")
        worker 0 of 1
    """
    cluster = _cluster.parse_tf_config()
    if cluster is not None and cluster.task_type == "evaluator":
        # Outside the training cluster whatever strategy it evaluates with.
        return WorkerInfo(cluster.num_workers, -1, False, "evaluator")
    if strategy is None and not tf.distribute.has_strategy():
        # No strategy in scope (the top of a script, a callback's own
        # thread): the job's cluster says where this process stands.
        if cluster is not None and cluster.num_workers > 1:
            return WorkerInfo(cluster.num_workers, cluster.rank, cluster.is_chief,
                              cluster.task_type)
        if cluster is None and _cluster.slurm_num_tasks() > 1:
            rank = int(os.environ.get("SLURM_PROCID", "0"))
            return WorkerInfo(_cluster.slurm_num_tasks(), rank, rank == 0)
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    elif not isinstance(strategy, tf.distribute.Strategy):
        strategy = resolve_strategy(strategy)
    resolver = getattr(strategy, "cluster_resolver", None)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        resolver is not None
    ):
        spec = resolver.cluster_spec().as_dict()
        if not spec:
            return WorkerInfo(1, 0, True)
        info = _cluster.ClusterInfo(
            cluster={k: list(v) if isinstance(v, list) else list(v.values()) for k, v in spec.items()},
            task_type=resolver.task_type,
            task_index=int(resolver.task_id),
        )
        return WorkerInfo(info.num_workers, info.rank, info.is_chief, info.task_type)
    if isinstance(strategy, tf.distribute.TPUStrategy):
        hosts = getattr(strategy.extended, "num_hosts", 1)
        return WorkerInfo(hosts, 0, True)
    return WorkerInfo(1, 0, True)


def _local_default_device() -> str:
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def _public_name(strategy: tf.distribute.Strategy) -> str:
    # Public names: TF's classes carry internal names (MWMS is
    # CollectiveAllReduceStrategy).
    for cls, name in (
        (tf.distribute.MultiWorkerMirroredStrategy, "MultiWorkerMirroredStrategy"),
        (tf.distribute.TPUStrategy, "TPUStrategy"),
        (tf.distribute.MirroredStrategy, "MirroredStrategy"),
        (tf.distribute.OneDeviceStrategy, "OneDeviceStrategy"),
    ):
        if isinstance(strategy, cls):
            return name
    if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
        return "DefaultStrategy"
    return type(strategy).__name__


def describe(strategy: StrategySpec | None = None) -> str:
    """One-line human summary of a strategy.

    Says its kind, the replicas in sync, the number of workers, this
    worker's rank and whether it is the chief, and the local devices.

    Args:
        strategy: A strategy or a spec for `resolve_strategy`; defaults to the
            strategy in scope (the default strategy outside any scope).

    Returns:
        A string such as
        `"MirroredStrategy: 2 replicas, 1 worker (rank 0, chief), devices CPU:0, CPU:1"`.

    Example:

        >>> import keras_dist
        >>> keras_dist.describe("default")  # doctest: +ELLIPSIS
        'DefaultStrategy: 1 replica, 1 worker (rank 0, chief), devices ...'
    """
    strategy = tf.distribute.get_strategy() if strategy is None else resolve_strategy(strategy)
    info = worker_info(strategy)
    replicas = strategy.num_replicas_in_sync
    try:
        devices = tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no device list
        devices = (_local_default_device(),)
    short = ", ".join(d.split("device:")[-1] for d in devices)
    return (
        f"{_public_name(strategy)}: {replicas} replica{'s' if replicas != 1 else ''}, "
        f"{info.num_workers} worker{'s' if info.num_workers != 1 else ''} "
        f"(rank {info.rank}, {'chief' if info.is_chief else 'not chief'}), "
        f"devices {short}"
    )
