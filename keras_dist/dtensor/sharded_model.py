"""`shard`: train a Keras model with its variables sharded over a DTensor mesh.

`ShardedModel` is a `keras.Model` driven by Keras' own fit loop. It holds a
copy of the model whose every variable (and optimizer slot) is a DTensor
`DVariable` laid out as the `LayoutMap` says; each step moves the batch
onto the mesh (split over its `"batch"` axis when it has one) and runs on
that copy, and the loss and metrics are tracked by Keras on the host.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_dist import _collectives, _data, _fit_session, _keras_compat, _liveness
from keras_dist.dtensor.fully_sharded import FullySharded
from keras_dist.dtensor.layout_mapper import LayoutMapper, convolution_variables

BATCH_AXIS = "batch"


def shard(
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    layout_map: keras.distribution.LayoutMap | LayoutMapper | FullySharded | None = None,
) -> ShardedModel:
    """Returns a `ShardedModel`: `model` (built, compiled) with sharded variables.

    Args:
        model: A built and compiled Sequential or functional Keras model. It
            is left untouched; the copy starts from its weights.
        mesh: A `keras.distribution.DeviceMesh` over devices DTensor knows
            (`keras_dist.dtensor.initialize` first).
        layout_map: A `keras.distribution.LayoutMap`, a `LayoutMapper` to
            apply to the model (default: `LayoutMapper(mesh)`; on a mesh
            without a "model" axis, every variable replicated), or
            `FullySharded()`: fully sharded data parallelism (each large
            variable and its optimizer slots split over the "batch" axis,
            gathered for each step).

    Example:

        ```python
        keras_dist.dtensor.initialize(4)          # first thing in the program
        mesh = keras_dist.dtensor.make_mesh({"batch": 2, "model": 2})
        sharded = keras_dist.dtensor.shard(model, mesh)
        sharded.fit(x, y, batch_size=32, epochs=3)
        ```

    Raises:
        ValueError: the model is not built or not compiled.
    """
    return ShardedModel(model, mesh, layout_map)


class _Shards:
    """The sharded copy of a model (untracked by the Keras model holding it:
    its `DVariable`s are not the holder's weights)."""

    def __init__(self, model, mesh, dmesh, layouts):
        self.model = model
        self.mesh = mesh
        self.dmesh = dmesh
        self.layouts = layouts
        self.gathered = set()  # paths of variables gathered for each step (FullySharded)
        self.host_optimizer = None  # host copies of the optimizer's variables (backups)


class ShardedModel(keras.Model):
    """A Keras model whose variables live in shards over a DTensor mesh.

    Use `shard(model, mesh, layout_map)` to make one. It is a `keras.Model`
    trained by Keras' own `fit` / `evaluate` / `predict` loop (callbacks,
    `History`, `validation_data`, `sample_weight`, `class_weight`,
    `steps_per_execution`); each step runs on a copy of the model whose
    every variable and optimizer slot is a `DVariable` laid out as the map
    says, with the batch split over the mesh's `"batch"` axis. Its
    `optimizer` is that copy's (learning-rate callbacks change it), and
    `get_weights` / `set_weights` / `save` / `save_weights` /
    `load_weights` gather from and scatter to the shards. `weights` are a
    host mirror of the shards, refreshed at the end of every `fit` and
    before every `evaluate` (also `fit`'s validation).
    """

    def __init__(self, model, mesh, layout_map=None):
        _check_shardable(model, mesh)
        axes_by_path = _axes_by_path(model, mesh, layout_map)
        super().__init__(name=model.name)
        dmesh = _dtensor_mesh(mesh)
        by_source_path = {
            path: dtensor.Layout(
                [a if a is not None else dtensor.UNSHARDED for a in axes], dmesh
            )
            for path, axes in axes_by_path.items()
        }
        compile_config = model.get_compile_config()
        self._kd = _Shards(None, mesh, dmesh, by_source_path)
        # FullySharded: the variables split over the data-parallel axis,
        # gathered before each forward pass (the copy's paths, below).
        gathered = set()
        if isinstance(layout_map, FullySharded):
            gathered = {p for p, axes in axes_by_path.items() if layout_map.axis in axes}
        self._slot_prefixes = []
        with tf.variable_creator_scope(self._creator):
            copy = _clone(model)
        # The copy's paths can differ from the source's (a Sequential loaded
        # from a .keras file has no model name in its paths): key by the copy.
        layouts = {
            target.path: by_source_path[source.path]
            for source, target in zip(model.weights, copy.weights)
        }
        self._kd.layouts = layouts
        self._kd.gathered = {
            target.path for source, target in zip(model.weights, copy.weights)
            if source.path in gathered
        }
        for path, variable in zip(layouts, copy.weights):
            if dtensor.fetch_layout(variable.value) != layouts[path]:
                raise RuntimeError(
                    f"Variable {path!r} was created with layout "
                    f"{dtensor.fetch_layout(variable.value).sharding_specs}, not "
                    f"{layouts[path].sharding_specs} as the layout map says."
                )
        # Optimizer slots are named after their variable's path.
        self._slot_prefixes = sorted(
            ((p.replace("/", "_"), layout) for p, layout in layouts.items()),
            key=lambda item: -len(item[0]),
        )
        with tf.variable_creator_scope(self._creator):
            copy.compile(**keras.saving.deserialize_keras_object(compile_config))
            copy.optimizer.build(copy.trainable_variables)
        self._kd.model = copy
        # Keras' view: a plain mirror of the model (its layers for summary()
        # and the symbolic build; its weights refreshed from the shards), the
        # sharded copy's optimizer, the source's loss and metrics (computed
        # on the host from the gathered predictions).
        self.mirror = _clone(model)
        arguments = keras.saving.deserialize_keras_object(compile_config)
        arguments["optimizer"] = copy.optimizer
        self.compile(**arguments)
        self._compile_arguments = compile_config
        self._kd_steps = None
        self._kd_host_logs = {}
        self._kd_session = None  # the running fit's (keras_dist/_fit_session.py)
        self._kd_step_key = None
        self._copy_from(model)
        self.built = True

    # -- Keras model surface -----------------------------------------------

    @property
    def mesh(self) -> keras.distribution.DeviceMesh:
        return self._kd.mesh

    @property
    def layouts(self) -> dict:
        """`{variable.path: dtensor.Layout}` of the sharded copy's variables."""
        return self._kd.layouts

    def call(self, inputs, training=None):
        # Symbolic calls only (the build, summary()); every step runs sharded.
        return self.mirror(inputs, training=training)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, shuffle=True, sample_weight=None, **kwargs):
        """`keras.Model.fit`; each step runs on the shards.

        Every batch must split over the mesh's `"batch"` axis: checked for
        arrays and fixed-size datasets before any step. One fit path with
        `DistributedModel` (keras_dist/_fit_session.py): callbacks set up
        through the fit session, shuffled arrays ordered by a seed every
        process agrees on (Keras' order with TensorFlow's global seed set),
        each pass counted, so a backup resumes mid-epoch exactly.
        """
        self._check_data("fit", x, y, batch_size, needs_y=True,
                         validation_split=kwargs.get("validation_split", 0.0))
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(
                f"fit(): argument `epochs` must be a positive integer. Received: epochs={epochs!r}"
            )
        group = _collectives.group_of(self)
        if shuffle == "batch" and _is_arrays(x) and _collectives.is_multi_worker(group):
            raise ValueError(
                'fit(): shuffle="batch" is not supported on a mesh that spans '
                'several processes. Received: shuffle="batch". Use shuffle=True.'
            )
        x, y, sample_weight, batch_size, kwargs = _arrays_for_fit(
            x, y, sample_weight, batch_size, kwargs)
        session = _fit_session.FitSession(self, group, callbacks, mesh=self.mesh)
        session.describe_input(x, batch_size, kwargs.get("steps_per_epoch"),
                               (x, y, sample_weight))
        self._kd_session = session
        try:
            session.set_up()  # a backup to resume from gives the seed
            # Every process feeds the whole batch (each device takes its
            # part): the dataset is made for no strategy.
            x, y, sample_weight, dataset = _data.shuffled_input(
                session, x, y, sample_weight, batch_size, shuffle, tf.distribute.get_strategy())
            kwargs["validation_batch_size"] = kwargs.get("validation_batch_size") or batch_size
            if dataset is not None:
                batch_size, shuffle = None, False
            # Each epoch's iterator torn down off the training thread (after
            # sharded steps a teardown blocked for 100-200 ms); each of the
            # user's created when Keras creates it (a seeded reshuffle orders
            # each pass by how many were created before: as in plain Keras).
            with _keras_compat.lean_epoch_iterators(
                session.track_input(x),
                background_release=True, lazy=None if dataset is not None else False,
                own_input=dataset is not None,
            ):
                return super().fit(x, y, batch_size, epochs, self._verbose(verbose),
                                   self._callbacks(callbacks), shuffle=shuffle,
                                   sample_weight=sample_weight, **kwargs)
        finally:
            self._kd_session = None
            session.tear_down()
            self._refresh_mirror()

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """`keras.Model.evaluate`: the forward pass sharded, the loss and
        metrics from the gathered predictions (any number of samples)."""
        if not kwargs.get("_use_cached_eval_dataset", False):
            self._check_data("evaluate", x, y, batch_size, needs_y=True)
        self._refresh_mirror()  # weight regularizers read the mirror
        with _keras_compat.lean_epoch_iterators(background_release=True, lazy=False):
            return super().evaluate(x, y, batch_size, self._verbose(verbose), sample_weight,
                                    steps, self._callbacks(callbacks), return_dict, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """`keras.Model.predict`, gathered on the host (any number of samples)."""
        self._check_data("predict", x, None, batch_size, needs_y=False)
        return super().predict(x, batch_size, self._verbose(verbose), steps,
                               self._callbacks(callbacks))

    # -- one job of several processes (a mesh over them) ---------------------

    @staticmethod
    def _verbose(verbose):
        """Progress output from process 0 only, as a multi-worker
        `DistributedModel` prints it from its chief only."""
        return verbose if dtensor.num_clients() == 1 or dtensor.client_id() == 0 else 0

    @staticmethod
    def _callbacks(callbacks):
        """On a mesh over several processes: Keras' file-writing callbacks
        (TensorBoard, CSVLogger, RemoteMonitor) on process 0 only, and
        Keras' `BackupAndRestore` writing process 0's backup only, as for a
        multi-worker `DistributedModel`: a job leaves what one process
        leaves. `ModelCheckpoint` runs everywhere: its `save` gathers on
        every process and writes on process 0 (`save`)."""
        if dtensor.num_clients() == 1:
            return callbacks
        return _collectives.callbacks_for_this_process(callbacks,
                                                       chief=dtensor.client_id() == 0)

    def _written_by_process_zero(self, write, filepath) -> None:
        """`write()` on process 0 only, every process returning once the
        file is complete (one all-reduce after the write, which also tells
        the others whether it failed). A single process just writes."""
        if dtensor.num_clients() == 1:
            write()
            return
        error = None
        if dtensor.client_id() == 0:
            try:
                write()
            except BaseException as e:  # joins the others before raising
                error = e
        [failed] = _collectives.agree_any(self.__keras_dist_process_group__(),
                                          [error is not None])
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"Process 0 of this job could not write {os.fspath(filepath)!r} "
                "(its output says why); nothing was written by this process."
            )

    def make_train_function(self, force=False):
        # Composed as a DistributedModel's (keras_dist/_fit_session.py): the
        # step, wrapped by the fit session's step wrappers; rebuilt when
        # that composition changes.
        session = self._kd_session
        key = None if session is None else session.step_key()
        if self.train_function is None or force:
            # Traced again: what the steps captured (the optimizer's learning
            # rate, which a LearningRateScaler replaces) may have changed.
            self._kd_steps = None
            self._kd_host_logs = {}  # traced again: compile may have new metrics
        elif key == self._kd_step_key:
            return self.train_function
        step, before_input = (
            (self._train_batch, None) if session is None else session.compose(self._train_batch)
        )
        self._kd_step_key = key
        self.train_function = self._per_execution(step, before_input)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self._kd_host_logs.pop("test", None)
            self.test_function = self._per_execution(self._test_batch)
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            def predict_function(batches):
                outputs = [_liveness.counted(self._forward, keras.utils.unpack_x_y_sample_weight(b)[0])
                           for b in batches]
                return tf.nest.map_structure(
                    lambda *parts: tf.concat(parts, axis=0), *outputs
                )

            self.predict_function = predict_function
        return self.predict_function

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights, gathered, as numpy arrays (Keras' order)."""
        return [self._get(v.value) for v in self._kd.model.weights]

    def set_weights(self, weights) -> None:
        """Scatters `weights` (Keras' order) to the shards."""
        targets = self._kd.model.weights
        if len(weights) != len(targets):
            raise ValueError(
                f"Argument `weights` has {len(weights)} arrays; the model has "
                f"{len(targets)} variables."
            )
        for target, value in zip(targets, weights):
            value = np.asarray(value)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"Variable {target.path!r} has shape {tuple(target.shape)}; "
                    f"argument `weights` gives {tuple(value.shape)}."
                )
        self._scatter(targets, weights)
        self._refresh_mirror()

    # -- variables ---------------------------------------------------------

    def _creator(self, next_creator, **kwargs):
        initial = kwargs["initial_value"]
        if callable(initial):
            initial = initial()
        initial = tf.convert_to_tensor(initial, dtype=kwargs.get("dtype"))
        name = kwargs.get("name") or ""
        scope = tf.get_current_name_scope()
        path = f"{scope}/{name}" if scope else name
        base = re.sub(r"^[^/]*/", "", path)
        layouts = self._kd.layouts
        layout = layouts.get(path, layouts.get(base))
        if layout is None:
            # A nested model's layers are built in their own scope: "dense"
            # for the variable whose path is "sequential/dense/kernel".
            nested = [key for key in layouts if key.endswith("/" + path)]
            if len(nested) == 1:
                layout = layouts[nested[0]]
        if layout is None:
            for prefix, candidate in self._slot_prefixes:
                if base.startswith(prefix + "_") and candidate.rank == initial.shape.rank:
                    layout = candidate
                    break
        if layout is None:
            layout = dtensor.Layout.replicated(self._kd.dmesh, initial.shape.rank)
        return dtensor.DVariable(
            self._put(initial, layout),
            trainable=kwargs.get("trainable", True),
            name=name or None,
        )

    def _put(self, value, layout):
        value = tf.convert_to_tensor(value)
        replicated = dtensor.copy_to_mesh(
            value, dtensor.Layout.replicated(self._kd.dmesh, value.shape.rank)
        )
        return dtensor.relayout(replicated, layout)

    def _from_chief(self, value, layout):
        """`_put`, with process 0's value on every process (multi-client).

        Under multi-client DTensor each process contributes its own local
        copy to a replicated value; unseeded initial weights differ between
        processes, so process 0's are summed with zeros from every other
        device (one all-reduce).
        """
        if dtensor.num_clients() == 1:
            return self._put(value, layout)
        return dtensor.relayout(self._summed(value, lambda device: device == 0), layout)

    def _summed(self, value, contributes):
        """The sum over the mesh's devices of `value` where
        `contributes(global device id)`, zeros elsewhere: replicated (one
        all-reduce every process joins)."""
        value = tf.convert_to_tensor(value)
        dmesh = self._kd.dmesh
        axes = list(dmesh.dim_names)
        ones = [1] * len(axes)
        components = [
            tf.reshape(value if contributes(device) else tf.zeros_like(value),
                       ones + value.shape.as_list())
            for device in dmesh.local_device_ids()
        ]
        stacked = dtensor.pack(
            components,
            dtensor.Layout(axes + [dtensor.UNSHARDED] * value.shape.rank, dmesh),
        )
        return tf.reduce_sum(stacked, axis=list(range(len(axes))))

    def __keras_dist_process_group__(self):
        """The processes of a mesh over several (None on one): what keras_dist's
        `BackupAndRestore` agrees with, as with a multi-worker strategy's
        workers (process 0 is the chief)."""
        if dtensor.num_clients() == 1:
            return None
        first = min(self._kd.dmesh.local_device_ids())

        def total(values):
            # Each process's values from its first device (float64 holds
            # the integers exactly: sequence numbers, flags, codes).
            summed = self._summed(tf.constant(values, tf.float64), lambda d: d == first)
            return [int(round(v)) for v in dtensor.unpack(summed)[0].numpy()]

        return _collectives.ProcessGroup(dtensor.client_id(), dtensor.num_clients(), total)

    def _get(self, value) -> np.ndarray:
        value = value.read_value() if hasattr(value, "read_value") else value
        rank = value.shape.rank
        gathered = dtensor.relayout(value, dtensor.Layout.replicated(self._kd.dmesh, rank))
        return dtensor.unpack(gathered)[0].numpy()

    def _refresh_mirror(self) -> None:
        for target, value in zip(self.mirror.weights, self.get_weights()):
            target.assign(value)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes each device holds, measured from the live variables' shards.

        Keys: `"variables"` (model weights), `"optimizer"` (its slots and
        counters) and `"replicated_variables"` / `"replicated_optimizer"`
        (what one device would hold with everything replicated).
        """
        def held(variables):
            on_device, whole = 0, 0
            for v in variables:
                value = v.value.read_value()
                shard = dtensor.unpack(value)[0]
                on_device += shard.numpy().nbytes
                whole += math.prod(value.shape) * value.dtype.size
            return on_device, whole

        model_bytes, model_whole = held(self._kd.model.weights)
        opt_bytes, opt_whole = held(self._kd.model.optimizer.variables)
        return {
            "variables": model_bytes,
            "optimizer": opt_bytes,
            "replicated_variables": model_whole,
            "replicated_optimizer": opt_whole,
        }

    # -- steps -------------------------------------------------------------

    def __keras_dist_data_parallel_size__(self) -> int:
        """How many ways each batch splits (the mesh's "batch" axis): the
        factor keras_dist's `LearningRateScaler` scales by."""
        return self._batch_split()

    def _batch_split(self) -> int:
        return dict(zip(self._kd.mesh.axis_names, self._kd.mesh.shape)).get(BATCH_AXIS, 1)

    def _to_mesh(self, structure):
        """A batch's tensors copied onto the mesh, replicated (the steps
        split them over "batch" inside their functions)."""
        if structure is None:
            return None

        def copy(value):
            value = tf.convert_to_tensor(value)
            return dtensor.copy_to_mesh(
                value, dtensor.Layout.replicated(self._kd.dmesh, value.shape.rank))

        return tf.nest.map_structure(copy, structure)

    @staticmethod
    def _local(structure):
        """This process's copy of replicated step outputs (no host copy)."""
        return tf.nest.map_structure(lambda v: dtensor.unpack(v)[0], structure)

    def _per_execution(self, run_batch, before_input=None):
        """A Keras train/test function: `steps_per_execution` batches per
        call; `before_input()` (a step wrapper's hook) before each read."""

        def function(iterator):
            logs = None
            for _ in range(self.steps_per_execution):
                if before_input is not None:
                    before_input()
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    if logs is None:
                        raise
                    break
                logs = _liveness.counted(run_batch, data)  # for a launcher's hang detection
            return logs

        return function

    def _steps(self):
        if self._kd_steps is None:
            self._kd_steps = _make_steps(self._kd.model, self._kd.layouts, self._kd.dmesh,
                                         BATCH_AXIS in self._kd.mesh.axis_names,
                                         self._kd.gathered)
        return self._kd_steps

    def _train_batch(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        count = _batch_size(x)
        split = self._batch_split()
        if count % split:
            raise ValueError(
                f"fit(): a batch of {count} samples cannot be split over the mesh "
                f"axis {BATCH_AXIS!r} of size {split}. Use a batch size divisible "
                f"by {split} (for a tf.data.Dataset: batch(..., drop_remainder=True))."
            )
        steps = self._steps()
        loss, y_pred, logits = self._local(steps.train(
            self._to_mesh(x), self._to_mesh(y), self._to_mesh(sample_weight)))
        return self._host_logs("train", x, y, y_pred, logits, steps.forms["train"],
                               sample_weight, loss)

    def _forward(self, x, with_logits=False):
        """Predictions for one batch, gathered; a short batch is padded to
        split over "batch" (its last sample repeated) and the padding dropped.
        `with_logits`: (predictions, the logits they came from)."""
        steps = self._steps()
        count = _batch_size(x)
        pad = -count % self._batch_split()
        if pad:
            x = tf.nest.map_structure(
                lambda a: tf.concat([a, tf.repeat(a[-1:], pad, axis=0)], axis=0), x
            )
        outputs, logits = self._local(steps.predict(self._to_mesh(x)))
        if pad:
            outputs, logits = tf.nest.map_structure(lambda o: o[:count], (outputs, logits))
        return (outputs, logits) if with_logits else outputs

    def _test_batch(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, logits = self._forward(x, with_logits=True)
        return self._host_logs("test", x, y, y_pred, logits, self._steps().forms["predict"],
                               sample_weight, None)

    def _host_logs(self, mode, x, y, y_pred, logits, forms, sample_weight, loss):
        """Keras' loss tracker and compiled metrics, on the host, as Keras'
        own step computes them: each prediction a softmax or sigmoid made
        carries the logits it came from (Keras' crossentropies read those,
        not the probabilities: a different number otherwise). `loss`: the
        step's (training), or None to compute it here (evaluation)."""
        functions = self._kd_host_logs
        if mode not in functions:
            # One function per mode: each may build Keras' loss and metric
            # state on its first trace.
            functions[mode] = tf.function(self._logs_in_graph, autograph=False)
        return functions[mode](x, y, y_pred, logits, tuple(forms), sample_weight, loss)

    def _logs_in_graph(self, x, y, y_pred, logits, forms, sample_weight, loss):
        y_pred = _keras_compat.with_logits(y_pred, logits, forms)
        if loss is None:
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                     training=False)
        elif len(tf.nest.flatten(y_pred)) > 1:
            # A multi-output model logs each output's loss: Keras updates
            # those trackers in compute_loss, here from the gathered
            # predictions (the step's loss is the sharded one).
            self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                              training=True)
        _keras_compat.loss_tracker(self).update_state(
            loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0]
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _check_data(self, method, x, y, batch_size, needs_y, validation_split=0.0):
        split = self._batch_split()
        if isinstance(x, tf.data.Dataset):
            _check_dataset(method, x, y, split)
        elif _is_arrays(x):
            _check_arrays(method, x, y, batch_size, needs_y, validation_split, split)
        # A generator or PyDataset: each batch is checked as it comes.

    # -- saving --------------------------------------------------------------

    def to_keras(self) -> keras.Model:
        """A plain compiled `keras.Model` holding the gathered weights and optimizer state.

        What `save` and `save_weights` write; hand it to code that expects an
        unsharded model (export, serving).
        """
        host = _clone(self.mirror)
        host.compile(**keras.saving.deserialize_keras_object(self._compile_arguments))
        host.optimizer.build(host.trainable_variables)
        for target, value in zip(host.weights, self.get_weights()):
            target.assign(value)
        for target, source in zip(host.optimizer.variables,
                                  self._kd.model.optimizer.variables):
            target.assign(self._get(source.value))
        return host

    def save(self, filepath, overwrite=True, **kwargs) -> None:
        """Saves a `.keras` file gathered to replicated, optimizer state included.

        `keras_dist.dtensor.load_model(filepath, mesh)` re-shards it onto any
        mesh; `keras.saving.load_model(filepath)` loads it unsharded. On a
        mesh over several processes call it on every process (each gathers
        the weights): process 0 writes the file, and every process returns
        once it is complete.
        """
        _check_suffix("filepath", filepath, ".keras")
        host = self.to_keras()  # gathered on every process of the mesh
        self._written_by_process_zero(
            lambda: host.save(filepath, overwrite=overwrite, **kwargs), filepath)

    def save_weights(self, filepath, overwrite=True, **kwargs) -> None:
        """Saves the gathered weights and optimizer state to a `.weights.h5` file."""
        _check_suffix("filepath", filepath, ".weights.h5")
        host = self.to_keras()  # gathered on every process of the mesh
        self._written_by_process_zero(
            lambda: host.save_weights(filepath, overwrite=overwrite, **kwargs), filepath)

    def load_weights(self, filepath, *args, **kwargs) -> None:
        """Loads a `.weights.h5` file (saved from any mesh, or by Keras) and re-shards it."""
        _check_suffix("filepath", filepath, ".weights.h5")
        if not os.path.isfile(filepath):
            raise FileNotFoundError(
                f"Argument `filepath` names no file. Received: filepath={filepath!r}"
            )
        host = self.to_keras()
        host.load_weights(filepath, *args, **kwargs)
        self._copy_from(host)

    # -- backups (keras_dist.callbacks.BackupAndRestore) --------------------

    def __keras_dist_backup_variables__(self) -> dict[str, list]:
        """Host variables holding the live training state, refreshed now
        from the shards: what keras_dist's `BackupAndRestore` writes and
        restores. Whole arrays (not shards), so a backup resumes on any mesh.

        `"model"`: the mirror's variables (weights and the seed generators'
        states); `"optimizer"`: a host copy of each optimizer variable.
        """
        sharded, mirror = self._kd.model.variables, self.mirror.variables
        slots = self.optimizer.variables
        if self._kd.host_optimizer is None:
            self._kd.host_optimizer = [
                keras.Variable(np.zeros(v.shape, v.dtype), dtype=v.dtype, trainable=False,
                               name=v.name)
                for v in slots
            ]
        host = self._kd.host_optimizer
        if len(sharded) != len(mirror) or len(host) != len(slots):
            raise RuntimeError(
                f"The sharded copy has {len(sharded)} variables and "
                f"{len(slots)} optimizer variables; the host mirror "
                f"{len(mirror)} and {len(host)}."
            )
        for target, source in [*zip(mirror, sharded), *zip(host, slots)]:
            target.assign(self._get(source.value))
        return {"model": list(mirror), "optimizer": list(host)}

    def __keras_dist_restore_backup_variables__(self) -> None:
        """Scatters the host variables of `__keras_dist_backup_variables__` (just read
        from a backup) onto the shards, in this mesh's layouts."""
        self._scatter(self._kd.model.variables, [v.numpy() for v in self.mirror.variables])
        self._scatter(self.optimizer.variables,
                      [v.numpy() for v in self._kd.host_optimizer])

    def _scatter(self, targets, values) -> None:
        """Assigns each whole value to its sharded variable, in its layout
        (process 0's value on every process)."""
        for target, value in zip(targets, values):
            target.assign(
                self._from_chief(np.asarray(value), dtensor.fetch_layout(target.value))
            )

    def _copy_from(self, source: keras.Model) -> None:
        """Assigns `source`'s weights (and optimizer state, when built) to the shards."""
        copy = self._kd.model
        if len(source.weights) != len(copy.weights):
            raise ValueError(
                f"The weights come from a different model: {len(source.weights)} "
                f"variables, this model has {len(copy.weights)}."
            )
        self.set_weights([w.numpy() for w in source.weights])
        slots = source.optimizer.variables if source.optimizer is not None else []
        targets = copy.optimizer.variables
        if len(slots) == len(targets) and all(
            tuple(a.shape) == tuple(b.shape) for a, b in zip(slots, targets)
        ):
            self._scatter(targets, [v.numpy() for v in slots])


def _clone(model: keras.Model) -> keras.Model:
    """`keras.models.clone_model`, keeping each `Lambda`'s own function."""
    return keras.models.clone_model(model, clone_function=_keras_compat.clone_layer)


@dataclasses.dataclass
class _Steps:
    """The sharded copy's functions, and what its outputs are (`forms`)."""

    train: Callable  # (x, y, sample_weight) -> (loss, y_pred, logits)
    predict: Callable  # x -> (y_pred, logits)
    forms: dict  # "train"/"predict" -> per flat output: see `logits_of`


def _batch_size(x) -> int:
    first = tf.nest.flatten(x)[0]
    size = first.shape[0]
    return int(size) if size is not None else int(tf.shape(first)[0])


def _make_steps(model, layouts, dmesh, split_batch: bool, gathered=frozenset()) -> _Steps:
    """The sharded copy's train step and forward pass. They take the batch
    replicated on the mesh and split it over "batch" themselves; what they
    return is replicated (every device holds all of it), so the host reads
    one device's copy: no eager relayout per step. Variables in `gathered`
    (FullySharded) are gathered before the forward pass and their updates
    (a normalization's moving statistics) split back."""
    forms = {}
    to_gather = [v for v in model.weights if v.path in gathered]

    def running(forward):
        """`forward()` with the gathered variables' values (all-gathered)."""
        if not to_gather:
            return forward()
        values = [
            dtensor.relayout(tf.convert_to_tensor(v.value),
                             dtensor.Layout.replicated(dmesh, len(v.shape)))
            for v in to_gather
        ]
        with keras.StatelessScope(state_mapping=list(zip(to_gather, values))) as scope:
            result = forward()
        # What the forward pass assigned (moving statistics, the seed
        # generators' states: `variables`, not only `weights`), kept.
        for variable in model.variables:
            value = scope.get_current_value(variable)
            if value is not None and all(value is not v for v in values):
                layout = layouts.get(variable.path)  # none for a seed generator's state
                if layout is None:
                    layout = dtensor.Layout.replicated(dmesh, len(variable.shape))
                variable.assign(dtensor.relayout(value, layout))
        return result

    def split(structure):
        def one(value):
            if not split_batch or value.shape.rank == 0:
                return value
            axes = [BATCH_AXIS] + [dtensor.UNSHARDED] * (value.shape.rank - 1)
            return dtensor.relayout(value, dtensor.Layout(axes, dmesh))

        return None if structure is None else tf.nest.map_structure(one, structure)

    def whole(structure):
        return tf.nest.map_structure(
            lambda v: dtensor.relayout(v, dtensor.Layout.replicated(dmesh, v.shape.rank)),
            structure)

    @tf.function
    def gradients_of(x, y, sample_weight):
        def forward():
            y_pred = model(split(x), training=True)
            logits, form = _keras_compat.logits_of(y_pred)
            # The loss is computed on the whole outputs (gathered: every
            # device computes it, as one device would), with the logits
            # they came from, and the batch's labels as given: DTensor's
            # expansion of a loss's own ops failed on outputs sharded over
            # "model" (OneHot: "non-broadcastable operands") and over
            # "batch" (CTC's ScatterNd: "operand #1 does not dominate").
            y_pred, logits = whole(y_pred), whole(logits)  # also what the step returns
            seen = _keras_compat.with_logits(y_pred, logits, form)
            loss = model.compute_loss(x=x, y=y, y_pred=seen,
                                      sample_weight=sample_weight, training=True)
            return y_pred, logits, form, loss

        with tf.GradientTape() as tape:
            y_pred, logits, forms["train"], loss = running(forward)
            # As Keras' train step: a LossScaleOptimizer scales the loss (its
            # update unscales the gradients); other optimizers leave it.
            scaled = model.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, model.trainable_variables)
        # DTensor has no layout propagation for sparse updates
        # (ResourceScatterSub): embedding gradients are made dense.
        gradients = [
            tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in gradients
        ]
        # Each gradient in its variable's layout: a replicated bias next to a
        # column-sharded kernel otherwise got a gradient laid out like the
        # kernel's output, and its update came out wrong (107 away from one
        # device after 4 steps).
        gradients = [
            dtensor.relayout(g, layouts[v.path])
            for g, v in zip(gradients, model.trainable_variables)
        ]
        return whole(loss), y_pred, logits, gradients

    # The update runs in its own function: inside the one that computes the
    # gradients, with batch-sharded inputs, Keras' momentum and Adam updates
    # were lost or misordered (weights 0.1-30 away from one device after 8
    # steps; plain SGD was exact). Split, all match.
    @tf.function
    def apply(gradients):
        model.optimizer.apply(gradients, model.trainable_variables)

    def train(x, y, sample_weight):
        loss, y_pred, logits, gradients = gradients_of(x, y, sample_weight)
        apply(gradients)
        return loss, y_pred, logits

    @tf.function
    def predict(x):
        y_pred = running(lambda: model(split(x), training=False))
        logits, forms["predict"] = _keras_compat.logits_of(y_pred)
        return whole(y_pred), whole(logits)

    return _Steps(train, predict, forms)


def _arrays_for_fit(x, y, sample_weight, batch_size, kwargs):
    """Array input with Keras' defaults made explicit: NumPy arrays (array-
    likes such as pandas frames converted, so keras_dist orders them on
    every process alike), batch_size 32, and `validation_split` taken off
    as Keras takes it (the last samples, unshuffled), before any shuffle.
    Other input is returned unchanged."""
    if not _is_arrays(x):
        return x, y, sample_weight, batch_size, kwargs
    x, y, sample_weight = tf.nest.map_structure(
        lambda leaf: leaf if isinstance(leaf, (np.ndarray, tf.Tensor)) or leaf is None
        else np.asarray(leaf), (x, y, sample_weight))
    kwargs = dict(kwargs)
    if kwargs.get("validation_split") and kwargs.get("validation_data") is None:
        (x, y, sample_weight), kwargs["validation_data"] = _data.split_validation(
            (x, y, sample_weight), kwargs["validation_split"])
        kwargs["validation_split"] = 0.0
    return x, y, sample_weight, batch_size or 32, kwargs


def _is_arrays(x) -> bool:
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(
        isinstance(leaf, (np.ndarray, tf.Tensor)) or hasattr(leaf, "__array__")
        for leaf in leaves
    )


def load_model(
    filepath: str,
    mesh: keras.distribution.DeviceMesh,
    layout_map: keras.distribution.LayoutMap | LayoutMapper | None = None,
    custom_objects: dict | None = None,
) -> ShardedModel:
    """Loads a `.keras` file and shards it onto `mesh` (any mesh, not only the one saved from).

    The file may come from `ShardedModel.save` or from plain Keras; weights
    and, when present, optimizer state are re-sharded with `layout_map`
    (a `LayoutMap` or a `LayoutMapper`; default: `LayoutMapper(mesh)`).
    """
    _check_suffix("filepath", filepath, ".keras")
    if not os.path.isfile(filepath):
        raise FileNotFoundError(
            f"Argument `filepath` names no file. Received: filepath={filepath!r}"
        )
    model = keras.saving.load_model(filepath, custom_objects=custom_objects)
    return ShardedModel(model, mesh, layout_map)


def _check_suffix(name: str, value, suffix: str) -> None:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).endswith(suffix):
        raise ValueError(
            f"Argument `{name}` must be a path ending in {suffix!r}. Received: "
            f"{name}={value!r}"
        )


def _dtensor_mesh(mesh: keras.distribution.DeviceMesh):
    devices = [str(d).upper().replace("/DEVICE:", "") for d in np.ravel(mesh.devices)]
    kind = devices[0].split(":")[0]
    if dtensor.num_clients() > 1:
        # One mesh over every process's devices, numbered globally.
        expected = [f"{kind}:{i}" for i in range(dtensor.num_global_devices(kind))]
        if devices != expected:
            raise ValueError(
                "Under multi-client DTensor a mesh spans every device of every "
                f"process, in order: {[d.lower() for d in expected]}. Received a "
                f"mesh over {[d.lower() for d in devices]}. Use make_mesh(shape) "
                "without `devices`."
            )
        return dtensor.create_distributed_mesh(
            list(zip(mesh.axis_names, mesh.shape)), device_type=kind
        )
    return dtensor.create_mesh(
        list(zip(mesh.axis_names, mesh.shape)),
        devices=[f"{kind}:{d.split(':')[-1]}" for d in devices],
        device_type=kind,
    )


def _check_shardable(model, mesh) -> None:
    """What `shard()` refuses before it copies anything."""
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            "Argument `mesh` must be a keras.distribution.DeviceMesh (see "
            f"keras_dist.dtensor.make_mesh). Received: mesh={mesh!r} of type "
            f"{type(mesh).__name__}"
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"shard() needs a built model; {model.name!r} has no weights "
            "yet. Build it first (call it on a batch, or model.build())."
        )
    if not model.compiled or model.optimizer is None:
        raise ValueError(
            f"shard() needs a compiled model; compile {model.name!r} first "
            "(its optimizer, loss and metrics are copied)."
        )
    for layer in _keras_compat.iter_sublayers(model):
        if isinstance(layer, keras.layers.RNN) and not layer.unroll:
            raise ValueError(
                f"shard() cannot run layer {layer.name!r} "
                f"({type(layer).__name__}, unroll=False): DTensor has no "
                "layout propagation for the loop a recurrent layer runs "
                "(its TensorList ops). Build it with unroll=True (the steps "
                "become plain ops; measured equal to one device), or keep "
                "the model on keras_dist.distribute(model)."
            )


def _axes_by_path(model, mesh, layout_map) -> dict:
    """Each variable's mesh axes (None: replicated), from the layout map;
    convolutions replicated (DTensor runs them only so), with a warning
    where the map said otherwise."""
    if layout_map is None:
        # A mesh without a "model" axis (`{"batch": 4}`): data parallel,
        # every variable whole on every device.
        layout_map = (LayoutMapper(mesh) if "model" in mesh.axis_names
                      else keras.distribution.LayoutMap(mesh))
    if isinstance(layout_map, FullySharded):
        # Every layer runs on gathered values: convolutions included.
        found = layout_map.layouts(model, mesh)
        return {v.path: found.get(v.path, (None,) * len(v.shape)) for v in model.weights}
    if isinstance(layout_map, LayoutMapper):
        layout_map = layout_map.layout_map(model)
    elif not isinstance(layout_map, keras.distribution.LayoutMap):
        raise TypeError(
            "Argument `layout_map` must be a keras.distribution.LayoutMap, a "
            "keras_dist.dtensor.LayoutMapper, keras_dist.dtensor.FullySharded() "
            f"or None. Received: layout_map="
            f"{layout_map!r} of type {type(layout_map).__name__}"
        )
    axes_by_path = {}
    for variable in model.weights:
        layout = layout_map[variable.path]
        axes_by_path[variable.path] = (
            tuple(layout.axes) if layout is not None else (None,) * len(variable.shape)
        )
    for path in sorted(convolution_variables(model)):
        axes = axes_by_path[path]
        if any(a is not None for a in axes):
            # A LayoutMap written for another backend (Keras' examples
            # shard convolution kernels by output channel) carries over.
            warnings.warn(
                f"Variable {path!r} belongs to a convolution: replicated, not "
                f"laid out as {axes!r}. DTensor runs a convolution only with "
                "its filter and bias replicated. Map it to None in the layout "
                "map to silence this warning.",
                stacklevel=4,
            )
            axes_by_path[path] = (None,) * len(axes)
    return axes_by_path


def _check_dataset(method, x, y, split) -> None:
    if y is not None:
        raise ValueError(
            f"{method}(): argument `y` must be None when `x` is a "
            "tf.data.Dataset (it yields the targets). Received: "
            f"y of type {type(y).__name__}"
        )
    if split > 1 and method == "fit":
        # Checked before any step: a short last batch would otherwise fail
        # halfway through an epoch.
        for spec in tf.nest.flatten(x.element_spec):
            size = spec.shape[0] if spec.shape.rank else None
            if size is None or size % split:
                raise ValueError(
                    f"{method}(): the dataset's batches must have a fixed "
                    f"size divisible by the mesh axis {BATCH_AXIS!r} of size "
                    f"{split}. Received: element_spec={x.element_spec}. Batch "
                    "it with dataset.batch(n, drop_remainder=True), n "
                    f"divisible by {split}."
                )


def _check_arrays(method, x, y, batch_size, needs_y, validation_split, split) -> None:
    if batch_size is None:
        batch_size = 32  # Keras' default
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(
            f"{method}(): argument `batch_size` must be a positive integer. "
            f"Received: batch_size={batch_size!r}"
        )
    if method == "fit" and batch_size % split:
        # evaluate and predict pad a batch that does not split.
        raise ValueError(
            f"{method}(): argument `batch_size` must be divisible by the "
            f"mesh axis {BATCH_AXIS!r} of size {split}. Received: "
            f"batch_size={batch_size}"
        )
    if needs_y and y is None:
        raise ValueError(
            f"{method}(): argument `y` is required with array inputs. Received: y=None"
        )
    count = len(tf.nest.flatten(x)[0])
    if validation_split:
        count = int(math.floor(count * (1.0 - validation_split)))  # as Keras splits
    if method == "fit" and count % batch_size % split:
        raise ValueError(
            f"{method}(): the last batch of {count % batch_size} samples "
            f"({count} training samples, batch_size={batch_size}) cannot be split over "
            f"the mesh axis {BATCH_AXIS!r} of size {split}. Pass a number of "
            f"samples whose remainder is divisible by {split}."
        )
