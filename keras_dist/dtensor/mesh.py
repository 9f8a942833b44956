"""`initialize` and `make_mesh`: devices for tensor model parallelism."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence

import keras
import tensorflow as tf

from keras_dist import _liveness


def initialize(num_devices: int | None = None, device_type: str = "CPU") -> int:
    """Initializes DTensor's accelerator system; call it before TensorFlow starts.

    DTensor must set up its devices before TensorFlow initializes them (before
    the first op, model or strategy). On a CPU, `num_devices` first splits
    the CPU into that many logical devices (`keras_dist.simulate_replicas`),
    so a laptop or a CI runner can hold a mesh; on GPUs or TPUs leave it
    `None`. On a CPU it also gives TensorFlow at least two inter-op threads
    per device (DTensor's CPU collectives block one each while they wait).

    Args:
        num_devices: Optional positive integer: logical CPU devices to create
            (CPU only).
        device_type: `"CPU"` (default), `"GPU"` or `"TPU"`.

    Returns:
        The number of devices of `device_type` DTensor now sees.

    Example:

        >>> import keras_dist.dtensor
        >>> keras_dist.dtensor.initialize(4)  # doctest: +SKIP
        4

    Raises:
        ValueError: unknown `device_type`, or `num_devices` with a device
            type other than CPU.
        RuntimeError: TensorFlow has already initialized its devices.
    """
    if device_type not in ("CPU", "GPU", "TPU"):
        raise ValueError(
            "Invalid value for argument `device_type`. Expected one of "
            f"'CPU', 'GPU', 'TPU'. Received: device_type={device_type!r}"
        )
    if num_devices is not None:
        if device_type != "CPU":
            raise ValueError(
                "Argument `num_devices` only splits a CPU into logical "
                f"devices. Received: num_devices={num_devices!r}, device_type="
                f"{device_type!r}. Leave num_devices=None for GPUs and TPUs."
            )
        from keras_dist.strategy import simulate_replicas

        simulate_replicas(num_devices)
    from tensorflow.experimental import dtensor

    _multi_client_from_tf_config()
    multi_client = int(os.environ.get("DTENSOR_NUM_CLIENTS", "1")) > 1
    if multi_client:
        # For a launcher's liveness checks: the processes join one cluster
        # here (DTensor waits for its peers), as a multi-worker strategy does.
        _liveness.joining()

    try:
        if device_type == "CPU":
            # DTensor's CPU collectives hold an inter-op thread per device
            # while they wait: with fewer threads than devices (a 2-core
            # machine splitting 4 devices) a step can block for good.
            devices = len(tf.config.get_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0]) or [None])
            current = tf.config.threading.get_inter_op_parallelism_threads()
            if current < 2 * devices:
                tf.config.threading.set_inter_op_parallelism_threads(2 * devices)
                os.environ["TF_NUM_INTEROP_THREADS"] = str(2 * devices)
        dtensor.initialize_accelerator_system(device_type)
        if multi_client:
            _liveness.joined()
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            "keras_dist.dtensor.initialize() must run before TensorFlow "
            "initializes its devices (before the first op, model or "
            "strategy): call it at the top of the script, right after "
            f"importing keras_dist. TensorFlow said: {e}"
        ) from e
    return len(tf.config.list_logical_devices(device_type))


def _multi_client_from_tf_config() -> None:
    """Sets DTensor's multi-client variables from `TF_CONFIG` (one client per
    training task, chief first: what `keras-dist launch` starts), unless
    they are set already. A single process is left alone."""
    from keras_dist import _cluster, _keras_compat, _startup

    if "DTENSOR_JOBS" in os.environ:
        return
    cluster = _cluster.parse_tf_config()
    if cluster is None or cluster.num_workers < 2 or cluster.rank < 0:
        return
    if _startup.configured:
        # `import keras_dist` configured collectives for a multi-worker
        # strategy; DTensor configures its own for the same tasks.
        _keras_compat.forget_collectives()
        _startup.configured = False
    addresses = list(cluster.cluster.get("chief", [])) + list(cluster.cluster.get("worker", []))
    os.environ.update({
        "DTENSOR_JOBS": ",".join(addresses),
        "DTENSOR_JOB_NAME": "worker",
        "DTENSOR_NUM_CLIENTS": str(len(addresses)),
        "DTENSOR_CLIENT_ID": str(cluster.rank),
    })


def num_clients() -> int:
    """The processes one mesh spans (1 unless DTensor runs multi-client)."""
    from tensorflow.experimental import dtensor

    return dtensor.num_clients()


def make_mesh(
    shape: Mapping[str, int], devices: Sequence[str] | None = None
) -> keras.distribution.DeviceMesh:
    """A `keras.distribution.DeviceMesh` with named axes, e.g. `{"batch": 2, "model": 2}`.

    Args:
        shape: Ordered mapping of axis name to size. Their product must equal
            the number of devices.
        devices: Device names (default: every GPU, else every TPU, else
            every logical CPU, in order). Under multi-client DTensor (a
            `keras-dist launch` job), the default is every device of every
            process: `"cpu:0"` ... `"cpu:N-1"` numbered globally, process 0's
            first.

    Returns:
        The `DeviceMesh` (Keras' type: the same map works on every backend).

    Example:

        >>> import keras_dist.dtensor
        >>> mesh = keras_dist.dtensor.make_mesh({"batch": 1, "model": 1}, ["cpu:0"])
        >>> mesh.axis_names, mesh.shape
        (['batch', 'model'], (1, 1))

    Raises:
        TypeError: `shape` is not a mapping.
        ValueError: an axis name is not a non-empty string, a size is not a
            positive integer, or the sizes do not multiply to the number of
            devices.
    """
    if not isinstance(shape, Mapping) or not shape:
        raise TypeError(
            "Invalid type for argument `shape`. Expected a non-empty mapping "
            f"of axis name to size, e.g. {{'batch': 2, 'model': 2}}. "
            f"Received: shape={shape!r}"
        )
    for name, size in shape.items():
        if not isinstance(name, str) or not name:
            raise ValueError(
                "Invalid axis name in argument `shape`. Expected non-empty "
                f"strings. Received: {name!r} in shape={dict(shape)!r}"
            )
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"Invalid size for mesh axis {name!r}. Expected a positive "
                f"integer. Received: shape={dict(shape)!r}"
            )
    if devices is None:
        devices = _default_devices()
    devices = list(devices)
    total = 1
    for size in shape.values():
        total *= int(size)
    if total != len(devices):
        raise ValueError(
            f"The mesh shape {dict(shape)!r} needs {total} devices; there are "
            f"{len(devices)}: {devices}. Change the axis sizes, pass "
            "`devices`, or create more logical CPUs with "
            "keras_dist.dtensor.initialize(num_devices) before TensorFlow "
            "starts."
        )
    return keras.distribution.DeviceMesh(
        tuple(int(s) for s in shape.values()), list(shape), devices=devices
    )


def _default_devices() -> list[str]:
    from tensorflow.experimental import dtensor

    clients = dtensor.num_clients()
    for kind in ("GPU", "TPU", "CPU"):
        found = tf.config.list_logical_devices(kind)
        if clients > 1:
            # Once the multi-client cluster is up, TensorFlow lists every
            # client's devices: count this client's own, then number all of
            # them globally (every client has as many).
            me = dtensor.client_id()
            found = [d for d in found if _is_local(d.name, me)]
        if found:
            count = len(found) * clients
            return [f"{kind.lower()}:{i}" for i in range(count)]
    return []


def _is_local(name: str, client_id: int) -> bool:
    """Whether a device name is this process's (`localhost`, or its task)."""
    spec = tf.DeviceSpec.from_string(name)
    return spec.job in (None, "localhost") or spec.task in (None, client_id)
