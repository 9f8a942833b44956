"""`PerReplicaMetrics`: what each replica and each worker is doing."""

from __future__ import annotations

import copy
import csv
import numbers
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from keras_dist import _checks, _collectives
from keras_dist._checks import check_log_dir
from keras_dist.strategy import worker_info

_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()

# Columns of the running totals kept per replica in the graph.
_SAMPLES, _WAITED, _STEPS, _ELAPSED = 0, 1, 2, 3


class _ReplicaMonitor:
    """The in-graph half of `PerReplicaMetrics`, owned by one strategy.

    Every training step:
    1. before the step reads its input, a one-scalar all-reduce (a barrier)
       timed on each replica: the time a replica waits there is time it
       spent ready while a peer was not (e.g. a worker whose host is slow
       between steps). The barrier must come first: under
       MultiWorkerMirroredStrategy reading a distributed batch is itself a
       collective, and a fast worker would wait there, unmeasured;
    2. inside `strategy.run`, the same barrier again once the batch is
       there (a replica whose input came late), then the step itself (the model's `train_step`);
    3. one `all_gather` of each replica's local values: its running metric
       results (Keras' metric variables are per replica until read), the
       samples of its shard, its barrier wait and, with the built-in
       `train_step`, its compute time and gradient norm. With a single
       worker each replica keeps its own row instead, and the host reads
       every replica's copy when it logs.
    The gathered table is kept in variables that the host reads only when it
    logs: no extra host synchronization per step. With a single worker there
    is no peer to wait for (its step time is its wall time), and the two
    barriers are left out.
    """

    def __init__(self, strategy, gradient_norm: bool):
        self.strategy = strategy
        self.gradient_norm = gradient_norm
        self.multi_worker = worker_info(strategy).num_workers > 1
        self.keys: list[str] = []
        # Filled while the built-in train_step is traced. MirroredStrategy
        # traces each replica in its own thread: one dict per thread.
        self._local = threading.local()
        with strategy.scope():
            self.latest = tf.Variable(
                tf.zeros([0, 0]),
                shape=tf.TensorShape(None),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="kd_per_replica_latest",
            )
            self.totals = tf.Variable(
                tf.zeros([strategy.num_replicas_in_sync, 4], tf.float32),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="kd_per_replica_totals",
            )
            self.input_wait = tf.Variable(
                0.0,
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="kd_per_replica_input_wait",
            )
            # When this replica's last step ended (its host's clock,
            # seconds since the Unix epoch), or when its worker began the
            # epoch: each step's elapsed time is measured from it on the
            # replica's own clock.
            self.step_end = tf.Variable(
                0.0,
                dtype=tf.float64,
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="kd_per_replica_step_end",
            )

    @property
    def trace_values(self) -> dict:
        if not hasattr(self._local, "values"):
            self._local.values = {}
        return self._local.values

    @trace_values.setter
    def trace_values(self, values: dict) -> None:
        self._local.values = values

    def start_epoch(self) -> None:
        """Marks the epoch's start: its first step's elapsed time counts from now."""
        if self.multi_worker:
            self.step_end.assign(time.time())

    def tails(self, workers: int, rank: int):
        """Each worker's host seconds since its last step ended, or None
        (one worker). What runs after an epoch's last step (its callbacks)
        is that step's time, as the time between two steps is the next
        one's. One collective: every worker calls it at the same point."""
        if not self.multi_worker:
            return None
        last = float(self.strategy.experimental_local_results(self.step_end)[0].numpy())
        mine = [0] * workers
        mine[rank] = max(0, int((time.time() - last) * 1e6))
        return np.array(_collectives.agree_sum(self.strategy, mine), np.float64) / 1e6

    def before_input(self) -> list:
        """The barrier before a step reads its input (cross-replica context)."""
        monitor = self
        if not self.multi_worker:
            return []

        def barrier():
            context = tf.distribute.get_replica_context()
            arrived = tf.timestamp()
            with tf.control_dependencies([arrived]):
                done = context.all_reduce("SUM", tf.zeros([]))
            with tf.control_dependencies([done]):
                waited = tf.timestamp() - arrived
            return monitor.input_wait.assign(tf.cast(waited, tf.float32))

        results = self.strategy.run(barrier)
        return list(self.strategy.experimental_local_results(results))

    def wrap(self, step_function):
        monitor = self

        def monitored_step(data):
            context = tf.distribute.get_replica_context()
            monitor.trace_values = {}
            if monitor.multi_worker:
                with tf.control_dependencies(tf.nest.flatten(data)):
                    arrived = tf.timestamp()
                with tf.control_dependencies([arrived]):
                    barrier = context.all_reduce("SUM", tf.zeros([]))
                with tf.control_dependencies([barrier]):
                    started = tf.timestamp()
                    logs = step_function(data)
            else:
                logs = step_function(data)
            scalars = {
                k: v
                for k, v in (logs or {}).items()
                if isinstance(v, (tf.Tensor, tf.Variable)) and v.shape.rank == 0
            }
            monitor.keys = sorted(scalars)
            values = [tf.cast(scalars[k], tf.float32) for k in monitor.keys]
            if monitor.gradient_norm:
                values.append(
                    tf.cast(monitor.trace_values.get("grad_norm", float("nan")), tf.float32)
                )
            first = next(t for t in tf.nest.flatten(data) if t is not None)
            waited = compute = elapsed = tf.zeros([])
            ended = []
            if monitor.multi_worker:
                with tf.control_dependencies(values):
                    finished = monitor.trace_values.get("compute_done")
                    finished = tf.timestamp() if finished is None else finished
                compute = tf.cast(finished - started, tf.float32)
                waited = tf.cast(started - arrived, tf.float32) + monitor.input_wait
                with tf.control_dependencies([finished, *values]):
                    now = tf.timestamp()
                # This step's time on this replica's own clock, from the end
                # of its previous step (its host's time between steps
                # included): each worker's step time is measured by itself.
                elapsed = tf.cast(now - monitor.step_end, tf.float32)
                ended = [monitor.step_end.assign(now)]
            values += [tf.cast(tf.shape(first)[0], tf.float32), waited, elapsed, compute]
            row = tf.stack(values)[None, :]
            if monitor.multi_worker:
                table = context.all_gather(row, axis=0)
                computes = table[:, -1]
                # A replica that computes faster waits for the slowest one in
                # the gradient all-reduce: count that as waiting too.
                lag = tf.reduce_max(computes) - computes
                increments = tf.stack(
                    [table[:, -4], table[:, -3] + lag, tf.ones_like(lag), table[:, -2]],
                    axis=1,
                )
                latest = table[:, :-4]
            else:
                # One worker: every replica is in this process, and the host
                # reads each one's own copy (no collective per step).
                mine = tf.one_hot(
                    context.replica_id_in_sync_group,
                    context.num_replicas_in_sync,
                    dtype=tf.float32,
                )[:, None]
                increments = mine * tf.stack([row[0, -4], 0.0, 1.0, 0.0])[None, :]
                latest = row[:, :-4]
            updates = [
                monitor.latest.assign(latest),
                monitor.totals.assign_add(increments),
                *ended,
            ]
            with tf.control_dependencies(updates):
                return tf.nest.map_structure(tf.identity, logs)

        return monitored_step

    def read(self):
        """(latest values [replicas, keys], totals [replicas, 4]) on the host."""
        if self.multi_worker:
            return self.latest.numpy(), self.totals.numpy()
        local = self.strategy.experimental_local_results
        latest = [v.numpy() for v in local(self.latest)]
        totals = [v.numpy() for v in local(self.totals)]
        if any(v.ndim != 2 for v in latest):  # before the first step
            return np.zeros([0, 0], np.float32), sum(totals)
        return np.concatenate(latest), sum(totals)


class PerReplicaMetrics(keras.callbacks.Callback):
    """Per-replica metrics and per-worker step times, and straggler warnings.

    Data-parallel training reports one number per metric: the reduction over
    every replica. This callback also reports, for each replica, the loss and
    each compiled metric computed on that replica's shard alone and the
    samples it processed, and, for each worker, its step time, throughput
    and the slowest/fastest step-time ratio. A worker whose step time stays
    above `straggler_factor` times the median is named in a warning, once
    until it recovers.

    Keys (epoch logs and History, CSV columns, TensorBoard tags):
    `{metric}/replica_{r}` (e.g. `loss/replica_0`; running value over the
    epoch, like the progress bar's), `samples/replica_{r}` (this epoch),
    `grad_norm/replica_{r}` (last step, with `gradient_norm=True`),
    `step_time/worker_{w}` (seconds per step the worker was busy: its
    step's wall time minus the time it waited for its peers),
    `samples_per_sec/worker_{w}` and `step_time_ratio`. The progress bar
    keeps showing the global values.

    How it is measured: inside each training step one scalar all-reduce
    times how long each replica waits for the others (time a peer made it
    wait), and one `all_gather` collects every replica's values; with the
    built-in `train_step` the gradient computation is timed as well, so a
    slower device counts against its own worker. Values stay in the graph
    until they are logged: the host reads them every `update_freq` steps,
    every `straggler_steps` steps and at the end of each epoch. Each
    worker's time is taken on its own clock, step by step in the graph (from
    the end of its previous step); at each epoch's end one more collective
    adds each worker's time after its last step (that batch's callbacks).
    Every worker runs the same collectives; only the chief writes files.

    Requires a `DistributedModel` (see `keras_dist.distribute`).

    Args:
        update_freq: `"epoch"` (default) or a positive int: how often rows
            are written to `csv_path` and `log_dir`. Epoch logs always get
            the values at the end of each epoch.
        csv_path: Path of a CSV file (one row per update), or None.
        log_dir: Directory for TensorBoard summaries (written with
            `tf.summary`; the `tensorboard` package is not needed), or None.
        gradient_norm: Boolean, default False. Also reports each replica's
            local gradient norm (before the all-reduce), for the built-in
            `train_step`. Costs one norm over the gradients per step.
        straggler_factor: Number > 1, default 1.5. A worker whose step time
            exceeds this times the median of the workers' is a straggler.
        straggler_steps: Positive int, default 20. Step times are compared
            over windows of this many steps; a straggler is reported when it
            is slow over a whole window.

    Example:

        >>> import keras, keras_dist, numpy as np
        >>> inputs = keras.Input((3,))
        >>> model = keras_dist.DistributedModel(
        ...     inputs, keras.layers.Dense(1)(inputs), strategy="default")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(
        ...     np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
        ...     callbacks=[keras_dist.callbacks.PerReplicaMetrics()])
        >>> history.history["samples/replica_0"]
        [8.0]

    Raises:
        ValueError / TypeError: for invalid arguments (here); at the start of
            `fit` for a model that is not a `DistributedModel`, or
            `gradient_norm=True` with a custom `train_step`.
    """

    def __init__(
        self,
        update_freq: Literal["epoch"] | int = "epoch",
        *,
        csv_path: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        gradient_norm: bool = False,
        straggler_factor: float = 1.5,
        straggler_steps: int = 20,
    ):
        super().__init__()
        if update_freq != "epoch" and not _checks.is_positive_int(update_freq):
            raise ValueError(
                "Invalid value for argument `update_freq`. Expected \"epoch\" "
                f"or a positive integer. Received: update_freq={update_freq!r}"
            )
        for name, value in (("csv_path", csv_path), ("log_dir", log_dir)):
            if value is not None and (
                not isinstance(value, (str, os.PathLike)) or not os.fspath(value)
            ):
                raise ValueError(
                    f"Invalid value for argument `{name}`. Expected None or a "
                    f"non-empty path. Received: {name}={value!r}"
                )
        if csv_path is not None and os.path.isdir(csv_path):
            raise ValueError(
                "Invalid value for argument `csv_path`: it is a directory. "
                f"Received: csv_path={csv_path!r}. Pass a file path, e.g. "
                f"{os.path.join(os.fspath(csv_path), 'replicas.csv')!r}."
            )
        check_log_dir(log_dir)
        if not isinstance(gradient_norm, bool):
            raise TypeError(
                "Invalid type for argument `gradient_norm`. Expected a bool. "
                f"Received: gradient_norm={gradient_norm!r}"
            )
        if (
            not isinstance(straggler_factor, numbers.Real)
            or isinstance(straggler_factor, bool)
            or not straggler_factor > 1
        ):
            raise ValueError(
                "Invalid value for argument `straggler_factor`. Expected a "
                f"number > 1. Received: straggler_factor={straggler_factor!r}"
            )
        if not _checks.is_positive_int(straggler_steps):
            raise ValueError(
                "Invalid value for argument `straggler_steps`. Expected a "
                f"positive integer. Received: straggler_steps={straggler_steps!r}"
            )
        # Configuration: survives across fit() calls.
        self.update_freq = update_freq
        self.csv_path = None if csv_path is None else os.fspath(csv_path)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.gradient_norm = gradient_norm
        self.straggler_factor = float(straggler_factor)
        self.straggler_steps = int(straggler_steps)
        # One monitor per strategy (its variables live on that strategy).
        self._monitors: dict = {}
        self._run = None  # per-run state, reset in on_train_begin
        self._monitor = None  # this fit's monitor, set by setup_fit
        # On one worker Keras may run `on_train_batch_end` in a thread pool
        # (it does not touch the logs): the bookkeeping takes a lock. With
        # several workers it reads the timings every `straggler_steps` steps,
        # in step with the training loop (set in `setup_fit`).
        self.async_safe = True
        self._bookkeeping_lock = threading.Lock()

    def __deepcopy__(self, memo):
        # keras-tuner copies the callbacks of every trial: the copy gets the
        # configuration, a lock of its own and no in-graph monitors (their
        # variables belong to the strategy the original ran on).
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            if key == "_bookkeeping_lock":
                value = threading.Lock()
            elif key == "_monitors":
                value = {}
            elif key in ("_run", "_monitor") or isinstance(value, keras.Model):
                value = None  # per run; the model (Keras' own reference)
            else:
                value = copy.deepcopy(value, memo)
            copied.__dict__[key] = value
        return copied

    # -- the fit-session hook (keras_dist/_fit_session.py) -----------------

    def setup_fit(self, session) -> None:
        """Puts the in-graph monitor around this fit's train step."""
        session.claim("per_replica_metrics", self)
        if session.mesh is not None:
            raise ValueError(
                "Invalid callback in argument `callbacks`: PerReplicaMetrics "
                "measures the replicas of a tf.distribute strategy, each running "
                "its own copy of the step (its own metrics, its wait for the "
                f"others); a {type(session.model).__name__} runs one step over the "
                "whole mesh, its devices in lockstep inside every collective, and "
                "computes its metrics once, from the gathered predictions: there "
                "is no replica to time or compare. Received: callbacks=[..., "
                "PerReplicaMetrics(...), ...]. Remove it (per-replica numbers "
                "need a DistributedModel)."
            )
        if self.gradient_norm and session.custom_train_step:
            raise ValueError(
                "PerReplicaMetrics(gradient_norm=True) needs the built-in "
                f"train_step; {type(session.model).__name__} overrides "
                "train_step. Pass gradient_norm=False, or compute the norm in "
                "your train_step and return it in its logs (it is then "
                "reported per replica like any metric)."
            )
        strategy = session.strategy
        key = id(strategy)
        monitor = self._monitors.get(key)
        if monitor is None or monitor.strategy is not strategy:
            monitor = _ReplicaMonitor(strategy, self.gradient_norm)
            self._monitors[key] = monitor
        self.async_safe = not monitor.multi_worker
        session.wrap_train_step(
            self,
            monitor.wrap,
            before_input=monitor.before_input,
            gradient_monitor=monitor,
        )
        self._monitor = monitor
        session.add_teardown(self._end_session)

    def _end_session(self) -> None:
        self._monitor = None

    # -- per run -----------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        monitor = self._monitor
        if monitor is None:
            raise TypeError(
                "PerReplicaMetrics needs the fit of a keras_dist.DistributedModel "
                "(a plain keras.Model reduces every value across replicas inside "
                "its train step), with the callback in fit(callbacks=[...]). "
                f"Received: a model of type {type(model).__name__}. Convert it "
                "with keras_dist.distribute(model)."
            )
        strategy = model.distribute_strategy
        info = worker_info(strategy)
        replicas = strategy.num_replicas_in_sync
        per_worker = max(1, replicas // max(1, info.num_workers))
        self._run = _Run(
            monitor=monitor,
            chief=info.is_chief,
            rank=info.rank,
            workers=max(1, replicas // per_worker),
            per_worker=per_worker,
            window=_Window(time.perf_counter(), monitor.read()[1]),
        )
        if info.is_chief and self.log_dir:
            self._run.writer = tf.summary.create_file_writer(self.log_dir)

    # -- state for BackupAndRestore ------------------------------------------

    def get_state(self) -> dict:
        """What a resumed run continues from (saved by `BackupAndRestore`).

        The number of steps counted (the CSV's and TensorBoard's step axis
        continues from it) and the CSV's columns (a resumed run appends to
        the file instead of starting it again).
        """
        run = self._run or _Run()
        return {"steps": int(run.steps), "csv_columns": run.csv}

    def set_state(self, state: dict) -> None:
        """Continues the step count of a backed-up run (during `fit` only).

        Rows the interrupted run wrote after its backup are dropped from the
        CSV: the resumed run writes them again.
        """
        run = self._run
        if run is None:
            return
        run.steps = int(state.get("steps", 0))
        run.written = run.steps  # its row, if due, is in the CSV
        columns = state.get("csv_columns")
        if not columns or not self.csv_path or not run.chief:
            return
        run.csv = list(columns)
        if os.path.exists(self.csv_path):
            with open(self.csv_path, newline="") as f:
                rows = list(csv.reader(f))
            kept = rows[:1] + [
                row for row in rows[1:] if row and int(row[1]) <= run.steps
            ]
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerows(kept)
        else:
            with open(self.csv_path, "w", newline="") as f:
                csv.writer(f).writerow(["epoch", "step", *run.csv])

    def on_epoch_begin(self, epoch, logs=None):
        run = self._run
        run.epoch = epoch
        run.monitor.start_epoch()
        run.epoch_window = _Window(time.perf_counter(), run.monitor.read()[1])

    def on_train_batch_end(self, batch, logs=None):
        with self._bookkeeping_lock:
            self._on_train_batch_end()

    def _on_train_batch_end(self):
        run = self._run
        steps = int(getattr(self.model, "steps_per_execution", 1) or 1)
        run.steps += steps
        run.since_update += steps
        run.since_check += steps
        latest = totals = None
        if run.workers > 1 and run.since_check >= self.straggler_steps:
            run.since_check = 0
            latest, totals = run.monitor.read()
            now = time.perf_counter()
            self._check_stragglers(run.window.worker_times(now, totals, run))
            run.window = _Window(now, totals)
        if self.update_freq != "epoch" and run.since_update >= self.update_freq:
            run.since_update = 0
            if latest is None:
                latest, totals = run.monitor.read()
            values = self._values(latest, totals, run.epoch_window, run)
            self._write(values, run.steps)

    def on_epoch_end(self, epoch, logs=None):
        run = self._run
        latest, totals = run.monitor.read()
        tails = run.monitor.tails(run.workers, run.rank)
        values = self._values(latest, totals, run.epoch_window, run, tails)
        if logs is not None:
            logs.update(values)
        if run.written != run.steps:
            self._write(values, run.steps)

    def on_train_end(self, logs=None):
        run, self._run = self._run, None
        if run and run.writer is not None:
            run.writer.close()

    # -- values ------------------------------------------------------------

    def _values(self, latest, totals, window, run, tails=None) -> dict:
        monitor = run.monitor
        names = list(monitor.keys) + (["grad_norm"] if self.gradient_norm else [])
        values = {}
        for column, name in enumerate(names):
            if latest.ndim == 2 and column < latest.shape[1]:
                for replica, value in enumerate(latest[:, column]):
                    values[f"{name}/replica_{replica}"] = float(value)
        samples = totals[:, _SAMPLES] - window.totals[:, _SAMPLES]
        for replica, value in enumerate(samples):
            values[f"samples/replica_{replica}"] = float(value)
        times = window.worker_times(time.perf_counter(), totals, run, tails)
        if times is not None:
            step_times, wall = times
            for worker, value in enumerate(step_times):
                values[f"step_time/worker_{worker}"] = float(value)
            per_worker = samples.reshape(run.workers, run.per_worker).sum(axis=1)
            for worker, value in enumerate(per_worker):
                values[f"samples_per_sec/worker_{worker}"] = float(value / wall[worker])
            values["step_time_ratio"] = float(
                np.max(step_times) / max(np.min(step_times), 1e-12)
            )
        return values

    def _check_stragglers(self, times) -> None:
        if times is None:
            return
        step_times, _ = times
        run = self._run
        median = float(np.median(step_times))
        slow = {
            w for w, t in enumerate(step_times) if t > self.straggler_factor * median
        }
        for worker in sorted(slow - run.straggling):
            if run.chief:
                warnings.warn(
                    f"PerReplicaMetrics: worker {worker} is a straggler: "
                    f"{step_times[worker] * 1000:.1f} ms per step over the last "
                    f"{self.straggler_steps} steps, {step_times[worker] / median:.1f}x "
                    f"the median of the {len(step_times)} workers "
                    f"({median * 1000:.1f} ms). Check its input pipeline, host "
                    "load and device.",
                    stacklevel=2,
                )
        run.straggling = slow

    def _write(self, values: dict, step: int) -> None:
        run = self._run
        run.written = step
        if not run.chief or not values:
            return
        if self.csv_path:
            if run.csv is None:
                run.csv = sorted(values)
                directory = os.path.dirname(os.path.abspath(self.csv_path))
                os.makedirs(directory, exist_ok=True)
                with open(self.csv_path, "w", newline="") as f:
                    csv.writer(f).writerow(["epoch", "step", *run.csv])
            with open(self.csv_path, "a", newline="") as f:
                csv.writer(f).writerow(
                    [run.epoch, step, *(values.get(k, "") for k in run.csv)]
                )
        if run.writer is not None:
            with run.writer.as_default(step=step):
                for key, value in values.items():
                    # `tf.summary.scalar` needs the tensorboard package;
                    # `tf.summary.write` with the scalars plugin's metadata
                    # writes the same event without it.
                    tf.summary.write(
                        key,
                        tf.constant(value, tf.float32),
                        metadata=_SCALAR_METADATA,
                    )
            run.writer.flush()


@dataclass
class _Run:
    """One fit's state (from `on_train_begin` to `on_train_end`)."""

    monitor: object = None  # the replicas' counters (`_ReplicaMonitor`)
    chief: bool = True
    rank: int = 0  # this worker's index among `workers`
    workers: int = 1
    per_worker: int = 1  # replicas per worker
    steps: int = 0  # steps counted (the CSV's and TensorBoard's step axis)
    since_update: int = 0
    since_check: int = 0
    window: object = None  # `_Window` since the last straggler check
    epoch_window: object = None  # `_Window` since the epoch began
    epoch: int = 0
    straggling: set = field(default_factory=set)  # workers reported slow
    writer: object = None  # TensorBoard's, on the chief with log_dir
    csv: list | None = None  # the CSV's value columns, once written
    written: int | None = None  # step of the last row written


class _Window:
    """Host time and in-graph totals at the start of a measurement window."""

    def __init__(self, start: float, totals):
        self.start = start
        self.totals = np.array(totals, copy=True)

    def worker_times(self, now: float, totals, run, tails=None):
        """(busy seconds per step per worker, wall seconds per worker) or None.

        With several workers each one's time comes from its own clock,
        summed in the graph step by step (`_ELAPSED`), plus `tails` (each
        worker's time after its last step, at an epoch's end): the window of
        the worker that reads would not do, its epoch may begin while a
        peer's wait for it already runs. One worker: this host's wall time.
        """
        delta = totals - self.totals
        steps = float(delta[0, _STEPS]) if delta.size else 0.0
        if run.workers > 1:
            elapsed = delta[:, _ELAPSED].reshape(run.workers, run.per_worker)
            if tails is not None:  # each worker's time after its last step
                elapsed = elapsed + np.asarray(tails, np.float64)[:, None]
        else:
            elapsed = np.full([1, run.per_worker], now - self.start)
        if steps <= 0 or np.any(elapsed <= 0):
            return None
        # A worker is as busy as its busiest replica.
        waited = delta[:, _WAITED].reshape(run.workers, run.per_worker)
        busy = (elapsed - waited).max(axis=1) / steps
        return np.maximum(busy, 0.0), elapsed.max(axis=1)
