"""`shard`: train a Keras model with its variables sharded over a DTensor mesh.

A preview: `ShardedModel` is not a `keras.Model`; it holds a copy of the
model whose every variable (and optimizer slot) is a DTensor `DVariable`
laid out as the `LayoutMap` says, and trains it with its own step function
(Keras' fit iterator cannot carry DTensor inputs). Inputs are split over the
mesh's `"batch"` axis when it has one.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_dist.dtensor.layout_mapper import LayoutMapper, convolution_variables

BATCH_AXIS = "batch"


def shard(
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    layout_map: keras.distribution.LayoutMap | LayoutMapper | None = None,
) -> ShardedModel:
    """Returns a `ShardedModel`: `model` (built, compiled) with sharded variables.

    Args:
        model: A built and compiled Sequential or functional Keras model. It
            is left untouched; the copy starts from its weights.
        mesh: A `keras.distribution.DeviceMesh` over devices DTensor knows
            (`keras_dist.dtensor.initialize` first).
        layout_map: A `keras.distribution.LayoutMap`, or a `LayoutMapper` to
            apply to the model (default: `LayoutMapper(mesh)`).

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


class ShardedModel:
    """A compiled Keras model whose variables are sharded `DVariable`s.

    Use `shard(model, mesh, layout_map)` to make one.
    """

    def __init__(self, model, mesh, layout_map=None):
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
        if layout_map is None:
            layout_map = LayoutMapper(mesh)
        if isinstance(layout_map, LayoutMapper):
            layout_map = layout_map.layout_map(model)
        elif not isinstance(layout_map, keras.distribution.LayoutMap):
            raise TypeError(
                "Argument `layout_map` must be a keras.distribution.LayoutMap, a "
                f"keras_dist.dtensor.LayoutMapper or None. Received: layout_map="
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
                    stacklevel=3,
                )
                axes_by_path[path] = (None,) * len(axes)
        self.mesh = mesh
        self.dmesh = _dtensor_mesh(mesh)
        by_source_path = {}
        for variable in model.weights:
            axes = axes_by_path[variable.path]
            by_source_path[variable.path] = dtensor.Layout(
                [a if a is not None else dtensor.UNSHARDED for a in axes], self.dmesh
            )
        self.layouts: dict[str, dtensor.Layout] = by_source_path
        self._slot_prefixes = []
        with tf.variable_creator_scope(self._creator):
            self.model = keras.models.clone_model(model)
        # The copy's paths can differ from the source's (a Sequential loaded
        # from a .keras file has no model name in its paths): key by the copy.
        self.layouts = {
            target.path: by_source_path[source.path]
            for source, target in zip(model.weights, self.model.weights)
        }
        for path, variable in zip(self.layouts, self.model.weights):
            if dtensor.fetch_layout(variable.value) != self.layouts[path]:
                raise RuntimeError(
                    f"Variable {path!r} was created with layout "
                    f"{dtensor.fetch_layout(variable.value).sharding_specs}, not "
                    f"{self.layouts[path].sharding_specs} as the layout map says."
                )
        # Optimizer slots are named after their variable's path.
        self._slot_prefixes = sorted(
            ((p.replace("/", "_"), layout) for p, layout in self.layouts.items()),
            key=lambda item: -len(item[0]),
        )
        with tf.variable_creator_scope(self._creator):
            self.model.compile(
                **keras.saving.deserialize_keras_object(model.get_compile_config())
            )
            self.model.optimizer.build(self.model.trainable_variables)
        self._source = model
        self._compile_arguments = model.get_compile_config()
        self._copy_from(model)
        self._train_step = None
        self._predict_step = None
        self._host = None

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
        layout = self.layouts.get(path, self.layouts.get(base))
        if layout is None:
            for prefix, candidate in self._slot_prefixes:
                if base.startswith(prefix + "_") and candidate.rank == initial.shape.rank:
                    layout = candidate
                    break
        if layout is None:
            layout = dtensor.Layout.replicated(self.dmesh, initial.shape.rank)
        return dtensor.DVariable(
            self._put(initial, layout),
            trainable=kwargs.get("trainable", True),
            name=name or None,
        )

    def _put(self, value, layout):
        value = tf.convert_to_tensor(value)
        replicated = dtensor.copy_to_mesh(
            value, dtensor.Layout.replicated(self.dmesh, value.shape.rank)
        )
        return dtensor.relayout(replicated, layout)

    def _get(self, value) -> np.ndarray:
        value = value.read_value() if hasattr(value, "read_value") else value
        rank = value.shape.rank
        gathered = dtensor.relayout(value, dtensor.Layout.replicated(self.dmesh, rank))
        return dtensor.unpack(gathered)[0].numpy()

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights, gathered, as numpy arrays (Keras' order)."""
        return [self._get(v.value) for v in self.model.weights]

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

        model_bytes, model_whole = held(self.model.weights)
        opt_bytes, opt_whole = held(self.model.optimizer.variables)
        return {
            "variables": model_bytes,
            "optimizer": opt_bytes,
            "replicated_variables": model_whole,
            "replicated_optimizer": opt_whole,
        }

    # -- input -------------------------------------------------------------

    def _batch_split(self) -> int:
        return dict(zip(self.mesh.axis_names, self.mesh.shape)).get(BATCH_AXIS, 1)

    def _put_batch(self, array):
        array = np.asarray(array)
        axes = [dtensor.UNSHARDED] * array.ndim
        if BATCH_AXIS in self.mesh.axis_names:
            axes[0] = BATCH_AXIS
        return self._put(array, dtensor.Layout(axes, self.dmesh))

    def _inputs(self, structure):
        """Numpy arrays (or a nest of them) -> DTensors split over "batch"."""
        leaves = tf.nest.flatten(structure)
        count = len(leaves[0])
        split = self._batch_split()
        if count % split:
            raise ValueError(
                f"A batch of {count} samples cannot be split over the mesh axis "
                f"{BATCH_AXIS!r} of size {split}. Use a batch size divisible by "
                f"{split} (for a tf.data.Dataset: batch(..., drop_remainder=True))."
            )
        return tf.nest.map_structure(self._put_batch, structure)

    def _batches(self, x, y, batch_size, *, shuffle=False, rng=None, with_y=True):
        """Yields (x, y) numpy batches from arrays or a batched tf.data.Dataset."""
        if isinstance(x, tf.data.Dataset):
            for element in x.as_numpy_iterator():
                if with_y:
                    if not isinstance(element, tuple) or len(element) != 2:
                        raise ValueError(
                            "Argument `x` must yield (inputs, targets) pairs: "
                            "sample weights are not supported by ShardedModel. "
                            f"Received an element of type {type(element).__name__}"
                            + (f" with {len(element)} parts."
                               if isinstance(element, tuple) else ".")
                        )
                    yield element
                else:
                    yield (element[0] if isinstance(element, tuple) else element), None
            return
        count = len(tf.nest.flatten(x)[0])
        order = rng.permutation(count) if shuffle else np.arange(count)
        for start in range(0, count, batch_size):
            index = order[start : start + batch_size]
            xb = tf.nest.map_structure(lambda a, i=index: np.asarray(a)[i], x)
            yb = None if y is None else tf.nest.map_structure(
                lambda a, i=index: np.asarray(a)[i], y
            )
            yield xb, yb

    def _check_data(self, method, x, y, batch_size, needs_y):
        split = self._batch_split()
        if isinstance(x, tf.data.Dataset):
            if y is not None:
                raise ValueError(
                    f"{method}(): argument `y` must be None when `x` is a "
                    "tf.data.Dataset (it yields the targets). Received: "
                    f"y of type {type(y).__name__}"
                )
            if split > 1 and method == "fit":
                # Checked before any step: a short last batch would otherwise
                # fail halfway through an epoch.
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
            return
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(
                f"{method}(): argument `batch_size` must be a positive integer. "
                f"Received: batch_size={batch_size!r}"
            )
        if batch_size % split:
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
        if method == "fit" and count % batch_size % split:
            raise ValueError(
                f"{method}(): the last batch of {count % batch_size} samples "
                f"({count} samples, batch_size={batch_size}) cannot be split over "
                f"the mesh axis {BATCH_AXIS!r} of size {split}. Pass a number of "
                f"samples whose remainder is divisible by {split}."
            )

    # -- training ----------------------------------------------------------

    def _make_train_step(self):
        model = self.model
        layouts = self.layouts

        @tf.function
        def gradients_of(x, y):
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
            gradients = tape.gradient(loss, model.trainable_variables)
            # DTensor has no layout propagation for sparse updates
            # (ResourceScatterSub): embedding gradients are made dense.
            gradients = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                for g in gradients
            ]
            # Each gradient in its variable's layout: a replicated bias next
            # to a column-sharded kernel otherwise got a gradient laid out
            # like the kernel's output, and its update came out wrong (107
            # away from one device after 4 steps).
            gradients = [
                dtensor.relayout(g, layouts[v.path])
                for g, v in zip(gradients, model.trainable_variables)
            ]
            return loss, gradients

        # The update runs in its own function: inside the one that computes
        # the gradients, with batch-sharded inputs, Keras' momentum and Adam
        # updates were lost or misordered (weights 0.1-30 away from one
        # device after 8 steps; plain SGD was exact). Split, all match.
        @tf.function
        def apply(gradients):
            model.optimizer.apply(gradients, model.trainable_variables)

        def step(x, y):
            loss, gradients = gradients_of(x, y)
            apply(gradients)
            return loss

        return step

    def fit(self, x, y=None, batch_size: int = 32, epochs: int = 1, shuffle: bool = False,
            seed: int = 0, verbose: int = 0) -> dict:
        """Trains on numpy arrays (or nests of them) or a batched `tf.data.Dataset`.

        Args:
            x: Inputs: an array, a list/dict of arrays, or a `tf.data.Dataset`
                of `(inputs, targets)` batches (every batch divisible by the
                mesh's `"batch"` axis: `batch(..., drop_remainder=True)`).
            y: Targets for array inputs; `None` with a dataset.
            batch_size: Global batch for array inputs, split over `"batch"`.
            epochs: Passes over the data.
            shuffle: Reshuffle array inputs each epoch (seeded by `seed`).
            seed: Seed of the shuffle.
            verbose: 1 prints each epoch's mean loss.

        Returns:
            `{"loss": [mean training loss of each epoch]}`.
        """
        self._check_data("fit", x, y, batch_size, needs_y=True)
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(
                f"fit(): argument `epochs` must be a positive integer. Received: epochs={epochs!r}"
            )
        if self._train_step is None:
            self._train_step = self._make_train_step()
        history = {"loss": []}
        rng = np.random.default_rng(seed)
        for epoch in range(epochs):
            losses = []  # read once per epoch: no host sync per step
            for xb, yb in self._batches(x, y, batch_size, shuffle=shuffle, rng=rng):
                loss = self._train_step(self._inputs(xb), self._inputs(yb))
                losses.append((loss, len(tf.nest.flatten(xb)[0])))
            count = sum(n for _, n in losses)
            total = sum(float(self._get(loss)) * n for loss, n in losses)
            history["loss"].append(total / max(count, 1))
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs} - loss: {history['loss'][-1]:.4f}")
        return history

    def _predict_batches(self, x, y, batch_size, with_y):
        if self._predict_step is None:
            model = self.model
            self._predict_step = tf.function(lambda batch: model(batch, training=False))
        split = self._batch_split()
        for xb, yb in self._batches(x, y, batch_size, with_y=with_y):
            count = len(tf.nest.flatten(xb)[0])
            # A short last batch is padded (repeating its last sample) to
            # split over "batch"; the padding's predictions are dropped.
            pad = -count % split
            if pad:
                padded = tf.nest.map_structure(
                    lambda a: np.concatenate([a, np.repeat(a[-1:], pad, axis=0)]), xb
                )
            else:
                padded = xb
            pred = self._get(self._predict_step(self._inputs(padded)))
            yield xb, yb, pred[:count]

    def predict(self, x, batch_size: int = 32) -> np.ndarray:
        """Predictions for arrays or a `tf.data.Dataset`, gathered on the host.

        Any number of samples: a short last batch is padded to split over the
        mesh's `"batch"` axis and the padding dropped.
        """
        self._check_data("predict", x, None, batch_size, needs_y=False)
        return np.concatenate(
            [pred for _, _, pred in self._predict_batches(x, None, batch_size, False)]
        )

    def evaluate(self, x, y=None, batch_size: int = 32) -> dict[str, float]:
        """Loss and compiled metrics, like `keras.Model.evaluate(return_dict=True)`.

        The forward pass runs sharded; the loss and metrics are computed from
        the gathered predictions with the model's compiled loss and metrics
        (sample-weighted mean over all batches, as Keras does).
        """
        self._check_data("evaluate", x, y, batch_size, needs_y=True)
        host = self._host_metrics()
        host.reset_metrics()
        total, count, results = 0.0, 0, {}
        for xb, yb, pred in self._predict_batches(x, y, batch_size, True):
            samples = len(pred)
            loss = host.compute_loss(x=xb, y=yb, y_pred=pred, training=False)
            total += float(loss) * samples
            count += samples
            results = host.compute_metrics(xb, yb, pred, sample_weight=None)
        results = {k: float(v) for k, v in results.items() if k != "loss"}
        return {"loss": total / max(count, 1), **results}

    def _plain_copy(self) -> keras.Model:
        """An unsharded, compiled copy of the source model (its own weights)."""
        host = keras.models.clone_model(self._source)
        host.compile(**keras.saving.deserialize_keras_object(self._compile_arguments))
        return host

    def _host_metrics(self) -> keras.Model:
        if self._host is None:
            self._host = self._plain_copy()
        return self._host

    # -- saving --------------------------------------------------------------

    def to_keras(self) -> keras.Model:
        """A plain compiled `keras.Model` holding the gathered weights and optimizer state.

        What `save` and `save_weights` write; hand it to code that expects a
        `keras.Model` (export, serving, Keras' own evaluate).
        """
        host = self._plain_copy()
        host.optimizer.build(host.trainable_variables)
        for target, value in zip(host.weights, self.get_weights()):
            target.assign(value)
        for target, source in zip(host.optimizer.variables, self.model.optimizer.variables):
            target.assign(self._get(source.value))
        return host

    def save(self, filepath: str) -> None:
        """Saves a `.keras` file gathered to replicated, optimizer state included.

        `keras_dist.dtensor.load_model(filepath, mesh)` re-shards it onto any
        mesh; `keras.saving.load_model(filepath)` loads it unsharded.
        """
        _check_suffix("filepath", filepath, ".keras")
        self.to_keras().save(filepath)

    def save_weights(self, filepath: str) -> None:
        """Saves the gathered weights and optimizer state to a `.weights.h5` file."""
        _check_suffix("filepath", filepath, ".weights.h5")
        self.to_keras().save_weights(filepath)

    def load_weights(self, filepath: str) -> None:
        """Loads a `.weights.h5` file (saved from any mesh, or by Keras) and re-shards it."""
        _check_suffix("filepath", filepath, ".weights.h5")
        if not os.path.isfile(filepath):
            raise FileNotFoundError(
                f"Argument `filepath` names no file. Received: filepath={filepath!r}"
            )
        host = self.to_keras()
        host.load_weights(filepath)
        self._copy_from(host)

    def _copy_from(self, source: keras.Model) -> None:
        """Assigns `source`'s weights (and optimizer state, when built) to the shards."""
        if len(source.weights) != len(self.model.weights):
            raise ValueError(
                f"The weights come from a different model: {len(source.weights)} "
                f"variables, this model has {len(self.model.weights)}."
            )
        for origin, target in zip(source.weights, self.model.weights):
            if tuple(origin.shape) != tuple(target.shape):
                raise ValueError(
                    f"Variable {target.path!r} has shape {tuple(target.shape)}; "
                    f"the weights given have {tuple(origin.shape)}."
                )
        for origin, target in zip(source.weights, self.model.weights):
            target.assign(self._put(origin.numpy(), self.layouts[target.path]))
        slots = source.optimizer.variables if source.optimizer is not None else []
        targets = self.model.optimizer.variables
        if len(slots) == len(targets) and all(
            tuple(a.shape) == tuple(b.shape) for a, b in zip(slots, targets)
        ):
            for origin, target in zip(slots, targets):
                target.assign(self._put(origin.numpy(), dtensor.fetch_layout(target.value)))


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
    return dtensor.create_mesh(
        list(zip(mesh.axis_names, mesh.shape)),
        devices=[f"{kind}:{d.split(':')[-1]}" for d in devices],
        device_type=kind,
    )
