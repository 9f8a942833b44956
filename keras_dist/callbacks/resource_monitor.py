"""`ResourceMonitor`: per-device memory and utilization in the training logs."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import time
from typing import Literal

import keras
import tensorflow as tf

from keras_dist.strategy import worker_info

_MB = 1024 * 1024


class ResourceMonitor(keras.callbacks.Callback):
    """Adds each device's memory and the host's memory and CPU use to the logs.

    What the guide's "monitor your devices" tip asks for, as a drop-in
    callback: the figures land in the epoch logs (and batch logs with an
    integer `update_freq`), so `History`, `CSVLogger`, `TensorBoard` and the
    progress bar show them.

    - Accelerators (GPU; TPU where TensorFlow reports it): `memory/<device>_mb`
      (allocated now) and `memory/<device>_peak_mb` (peak since the last
      report) from `tf.config.experimental.get_memory_info`, for each device
      of the model's strategy on this worker; with `nvidia-smi` on the PATH,
      `utilization/<device>_percent` (GPU busy time, sampled at the report).
    - Host: `memory/host_rss_mb` (resident memory of this process now),
      `memory/host_peak_rss_mb` (its peak) and `utilization/host_cpu_percent`
      (CPU time of this process over wall time since the last report; 100 =
      one core fully busy).

    Each worker of a multi-worker job measures its own host and devices; with
    `verbose=1` only the chief prints its line.

    Args:
        update_freq: `"epoch"` (default) or a positive int: also report every
            that many batches.
        verbose: 0 (default) or 1: print one line per report.

    Example:

        >>> import keras, keras_dist, numpy as np
        >>> inputs = keras.Input((3,))
        >>> model = keras_dist.DistributedModel(
        ...     inputs, keras.layers.Dense(1)(inputs), strategy="default")
        >>> model.compile("sgd", "mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0,
        ...     callbacks=[keras_dist.callbacks.ResourceMonitor()])
        >>> history.history["memory/host_rss_mb"][0] > 0
        True

    Raises:
        ValueError: `update_freq` or `verbose` is invalid.
    """

    def __init__(self, update_freq: Literal["epoch"] | int = "epoch", *, verbose: int = 0):
        super().__init__()
        if update_freq != "epoch" and (
            not isinstance(update_freq, int) or isinstance(update_freq, bool) or update_freq < 1
        ):
            raise ValueError(
                "Invalid value for argument `update_freq`. Expected \"epoch\" or a "
                f"positive integer. Received: update_freq={update_freq!r}"
            )
        if verbose not in (0, 1):
            raise ValueError(
                f"Invalid value for argument `verbose`. Expected 0 or 1. Received: "
                f"verbose={verbose!r}"
            )
        self.update_freq = update_freq
        self.verbose = verbose
        # Per run (reset in on_train_begin): the devices, the chief flag and
        # the CPU clock of the last report.
        self._devices: list[str] = []
        self._chief = True
        self._last = (0.0, 0.0)

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        self._chief = worker_info(strategy).is_chief
        self._devices = _accelerators(strategy)
        self._last = _cpu_clock()
        for device in self._devices:
            _reset_peak(device)

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq != "epoch" and (batch + 1) % self.update_freq == 0 and logs is not None:
            logs.update(self._report(f"batch {batch + 1}"))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._report(f"epoch {epoch + 1}"))

    def _report(self, where: str) -> dict[str, float]:
        values: dict[str, float] = {}
        for device in self._devices:
            name = device.replace(":", "_")
            try:
                info = tf.config.experimental.get_memory_info(device)
            except (ValueError, tf.errors.OpError):
                continue  # this device does not report memory
            values[f"memory/{name}_mb"] = info["current"] / _MB
            values[f"memory/{name}_peak_mb"] = info["peak"] / _MB
            _reset_peak(device)
        values.update(_gpu_utilization(self._devices))
        values["memory/host_rss_mb"] = _host_rss() / _MB
        values["memory/host_peak_rss_mb"] = _host_peak_rss() / _MB
        now = _cpu_clock()
        wall, cpu = now[0] - self._last[0], now[1] - self._last[1]
        values["utilization/host_cpu_percent"] = 100.0 * cpu / wall if wall > 0 else 0.0
        self._last = now
        if self.verbose and self._chief:
            print(f"ResourceMonitor {where}: " + ", ".join(
                f"{key} {value:.1f}" for key, value in values.items()), flush=True)
        return values


def _accelerators(strategy) -> list[str]:
    """This worker's accelerator devices under `strategy`, as "GPU:0" names."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # the default strategy: TensorFlow's default device
        return [f"{d.device_type}:{i}" for i, d in enumerate(
            tf.config.list_logical_devices("GPU")[:1])]
    names = []
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.device_type and spec.device_type != "CPU":
            names.append(f"{spec.device_type}:{spec.device_index or 0}")
    return names


def _reset_peak(device: str) -> None:
    # Where a device cannot reset it, its peak counts from the start.
    with contextlib.suppress(ValueError, tf.errors.OpError):
        tf.config.experimental.reset_memory_stats(device)


def _gpu_utilization(devices: list[str]) -> dict[str, float]:
    gpus = [d for d in devices if d.startswith("GPU:")]
    tool = shutil.which("nvidia-smi")
    if not gpus or tool is None:
        return {}
    try:
        out = subprocess.run(
            [tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {}
    # TensorFlow numbers the GPUs it sees in CUDA_VISIBLE_DEVICES order.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else None
    result = {}
    for device in gpus:
        index = int(device.split(":")[1])
        physical = order[index] if order and index < len(order) else index
        if physical < len(out):
            result[f"utilization/{device.replace(':', '_')}_percent"] = float(out[physical])
    return result


def _proc_status(field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/self/status in bytes (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host_rss() -> int:
    rss = _proc_status("VmRSS")
    return rss if rss is not None else _host_peak_rss()


def _host_peak_rss() -> int:
    peak = _proc_status("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # Linux: KiB


def _cpu_clock() -> tuple[float, float]:
    times = os.times()
    return time.monotonic(), times.user + times.system
