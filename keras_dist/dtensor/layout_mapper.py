"""`LayoutMapper`: a Megatron-style `keras.distribution.LayoutMap` for a model."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import Literal

import keras
import numpy as np

from keras_dist import _keras_compat

Axes = tuple  # of mesh axis names or None, one per variable dimension


class LayoutMapper:
    """Builds a `keras.distribution.LayoutMap` for a model, by layer type.

    Tensor (intra-layer) model parallelism in the Megatron-LM pattern, over
    the mesh axis `model_axis`:

    - `Dense` / `EinsumDense`, taken in order: the first of a pair is
      column-parallel (kernel `(None, "model")`, bias `("model",)`), the
      next row-parallel (kernel `("model", None)`, bias replicated), so the
      activation between them stays sharded and one all-reduce follows the
      pair. A layer whose output dimension does not divide by the axis
      (e.g. `Dense(1)`) stays replicated and does not start a pair.
    - `MultiHeadAttention`: heads are sharded (query/key/value kernels
      `(None, "model", None)`, their biases `("model", None)`, the output
      kernel `("model", None, None)`).
    - `Embedding`: the vocabulary (`embedding="vocabulary"`, default) or the
      embedding dimension (`embedding="dim"`).
    - Convolutions: replicated. DTensor runs a convolution only with a
      fully replicated filter (its SPMD expander refuses any other layout
      at the first step; a sharded bias after it fails too), so a rule that
      shards a convolution's variable is refused (`shard()` replicates one
      that a `LayoutMap` shards, with a warning).
    - Normalization layers, variables with fewer than `min_elements`
      elements and everything else: replicated (not in the map).
      `summary()` says why each variable is replicated.

    `rules` override any of it: `{regex: axes}` where the regex is matched
    with `re.fullmatch` against `variable.path` (Keras' `LayoutMap`
    semantics; a variable matching two rules is an error) and `axes` is a
    tuple of mesh axis names or `None` per dimension (`None` as the whole
    value: replicated). Every layout is checked against the variable's
    shape and the mesh.

    Args:
        mesh: A `keras.distribution.DeviceMesh` (see
            `keras_dist.dtensor.make_mesh`).
        model_axis: Name of the mesh axis layers are sharded over (default
            `"model"`).
        embedding: `"vocabulary"` (default) or `"dim"`: which dimension of
            an `Embedding` is sharded.
        min_elements: Non-negative integer, default 1024: variables with
            fewer elements stay replicated (their communication would cost
            more than their memory).
        rules: Optional mapping of regex to axes, applied over the automatic
            layouts.

    Example:

        >>> import keras, keras_dist.dtensor
        >>> mesh = keras_dist.dtensor.make_mesh({"model": 1}, ["cpu:0"])
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
        ...                           keras.layers.Dense(8)])
        >>> layout_map = keras_dist.dtensor.LayoutMapper(mesh, min_elements=0).layout_map(model)
        >>> layout_map[model.layers[0].kernel.path].axes
        (None, 'model')

    Raises:
        TypeError: `mesh` is not a `keras.distribution.DeviceMesh`, or
            `rules` is not a mapping.
        ValueError: unknown `model_axis` or `embedding`, bad
            `min_elements`, an invalid regex or axes in `rules`.
    """

    def __init__(
        self,
        mesh: keras.distribution.DeviceMesh,
        *,
        model_axis: str = "model",
        embedding: Literal["vocabulary", "dim"] = "vocabulary",
        min_elements: int = 1024,
        rules: Mapping[str, Axes | None] | None = None,
    ):
        if not isinstance(mesh, keras.distribution.DeviceMesh):
            raise TypeError(
                "Invalid type for argument `mesh`. Expected a "
                "keras.distribution.DeviceMesh (keras_dist.dtensor.make_mesh"
                f"). Received: mesh={mesh!r} of type {type(mesh).__name__}"
            )
        if model_axis not in mesh.axis_names:
            raise ValueError(
                "Invalid value for argument `model_axis`: not an axis of the "
                f"mesh {list(mesh.axis_names)}. Received: model_axis={model_axis!r}"
            )
        if embedding not in ("vocabulary", "dim"):
            raise ValueError(
                "Invalid value for argument `embedding`. Expected "
                f"'vocabulary' or 'dim'. Received: embedding={embedding!r}"
            )
        if (
            not isinstance(min_elements, numbers.Integral)
            or isinstance(min_elements, bool)
            or min_elements < 0
        ):
            raise ValueError(
                "Invalid value for argument `min_elements`. Expected a "
                f"non-negative integer. Received: min_elements={min_elements!r}"
            )
        if rules is not None and not isinstance(rules, Mapping):
            raise TypeError(
                "Invalid type for argument `rules`. Expected a mapping of "
                f"regex to axes. Received: rules={rules!r}"
            )
        self.mesh = mesh
        self.model_axis = model_axis
        self.embedding = embedding
        self.min_elements = int(min_elements)
        self.rules: dict[str, Axes | None] = {}
        for pattern, axes in (rules or {}).items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"Invalid regex {pattern!r} in argument `rules`: {e}"
                ) from None
            if axes is not None:
                axes = tuple(axes)
                for axis in axes:
                    if axis is not None and axis not in mesh.axis_names:
                        raise ValueError(
                            f"Invalid axes {axes!r} for rule {pattern!r} in "
                            f"argument `rules`: {axis!r} is not an axis of "
                            f"the mesh {list(mesh.axis_names)}. Use mesh axis "
                            "names or None."
                        )
            self.rules[pattern] = axes

    # -- the map -----------------------------------------------------------

    def layouts(self, model: keras.Model) -> dict[str, Axes]:
        """`{variable.path: axes}` for every sharded variable of `model`."""
        variables = _variables(model)
        layouts = {
            path: axes
            for path, axes in self._automatic(model).items()
            if math.prod(variables[path].shape) >= self.min_elements
        }
        for path in variables:
            matches = [p for p in self.rules if re.fullmatch(p, path)]
            if len(matches) > 1:
                raise ValueError(
                    f"Variable {path!r} matches more than one rule in "
                    f"`rules`: {matches}. Make the patterns exclusive "
                    "(Keras' LayoutMap allows at most one match)."
                )
            if matches:
                axes = self.rules[matches[0]]
                if axes is None or all(a is None for a in axes):
                    layouts.pop(path, None)
                else:
                    layouts[path] = axes
        convolutions = convolution_variables(model)
        for path, axes in layouts.items():
            self._validate(path, tuple(variables[path].shape), axes)
            if path in convolutions:
                raise ValueError(
                    f"Invalid layout {tuple(axes)!r} for variable {path!r} in "
                    "argument `rules`: it belongs to a convolution, and DTensor "
                    "runs a convolution only with its filter and bias fully "
                    "replicated (it fails at the first step otherwise). Map it "
                    "to None."
                )
        return layouts

    def layout_map(self, model: keras.Model) -> keras.distribution.LayoutMap:
        """A `keras.distribution.LayoutMap` with one exact key per sharded variable.

        Variables not in the map are replicated.
        """
        layout_map = keras.distribution.LayoutMap(self.mesh)
        for path, axes in self.layouts(model).items():
            layout_map[re.escape(path)] = keras.distribution.TensorLayout(
                axes, self.mesh
            )
        return layout_map

    def summary(self, model: keras.Model, print_fn: Callable[[str], None] | None = None) -> None:
        """Prints each variable's layout, bytes per device, why it is
        replicated (where it is), and the totals."""
        print_fn = print_fn or print
        layouts = self.layouts(model)
        reasons = self.replicated_reasons(model)
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        rows = []
        replicated_total = sharded_total = 0
        for path, variable in _variables(model).items():
            nbytes = math.prod(variable.shape) * np.dtype(variable.dtype).itemsize
            axes = layouts.get(path)
            split = math.prod(sizes[a] for a in axes if a is not None) if axes else 1
            per_device = nbytes // split
            replicated_total += nbytes
            sharded_total += per_device
            layout = "replicated" if axes is None else str(tuple(axes))
            rows.append((path, str(tuple(variable.shape)), layout, nbytes, per_device,
                         reasons.get(path, "")))
        width = max([len(r[0]) for r in rows] + [8])
        mesh = ", ".join(f"{n}={s}" for n, s in sizes.items())
        print_fn(f"LayoutMapper over mesh ({mesh}), model axis {self.model_axis!r}")
        print_fn(
            f"{'variable':<{width}}  {'shape':<16} {'layout':<28} "
            f"{'bytes':>12} {'per device':>12}  why replicated"
        )
        for path, shape, layout, nbytes, per_device, reason in rows:
            print_fn(
                f"{path:<{width}}  {shape:<16} {layout:<28} {nbytes:>12,} "
                f"{per_device:>12,}  {reason}".rstrip()
            )
        ratio = sharded_total / replicated_total if replicated_total else 1.0
        print_fn(
            f"total: {replicated_total:,} bytes replicated on every device; "
            f"{sharded_total:,} bytes per device with this map ({ratio:.1%})"
        )

    # -- rules by layer type -----------------------------------------------

    def _automatic(self, model) -> dict[str, Axes]:
        axis = self.model_axis
        n = dict(zip(self.mesh.axis_names, self.mesh.shape))[axis]
        layouts: dict[str, Axes] = {}
        handled: set[int] = set()
        pending_column = None  # a column-parallel layer waiting for its row
        for layer in _layers(model):
            if id(layer) in handled:
                continue
            if isinstance(layer, keras.layers.MultiHeadAttention):
                for sub in _layers(layer):
                    handled.add(id(sub))
                self._attention(layer, n, layouts)
                pending_column = None
            elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
                kernel = getattr(layer, "kernel", None)
                if kernel is None:
                    continue
                shape = tuple(kernel.shape)
                if pending_column is not None and shape[0] % n == 0:
                    layouts[kernel.path] = (axis,) + (None,) * (len(shape) - 1)
                    pending_column = None
                elif shape[-1] % n == 0:
                    layouts[kernel.path] = (None,) * (len(shape) - 1) + (axis,)
                    bias = getattr(layer, "bias", None)
                    if bias is not None and tuple(bias.shape)[-1:] == shape[-1:]:
                        layouts[bias.path] = (None,) * (len(bias.shape) - 1) + (axis,)
                    pending_column = layer
                else:
                    pending_column = None
            elif isinstance(layer, keras.layers.Embedding):
                table = layer.embeddings
                dim = 0 if self.embedding == "vocabulary" else 1
                if tuple(table.shape)[dim] % n == 0:
                    layouts[table.path] = (axis, None) if dim == 0 else (None, axis)
        return layouts

    def replicated_reasons(self, model: keras.Model) -> dict[str, str]:
        """`{variable.path: why}` for every variable the map replicates."""
        layouts = self.layouts(model)
        automatic = self._automatic(model)
        axis = self.model_axis
        n = dict(zip(self.mesh.axis_names, self.mesh.shape))[axis]
        reasons = {}
        for layer in _layers(model):
            for variable in layer.weights:
                path = variable.path
                if path in layouts or path in reasons:
                    continue
                matches = [p for p in self.rules if re.fullmatch(p, path)]
                if matches:
                    reasons[path] = f"rule {matches[0]!r}"
                elif path in automatic:
                    reasons[path] = f"fewer than min_elements={self.min_elements} elements"
                else:
                    reasons[path] = _why_replicated(layer, variable, automatic, f"{axis}={n}", n)
        return {
            path: reasons.get(path, "no rule for this layer type")
            for path in _variables(model)
            if path not in layouts
        }

    def _attention(self, layer, n, layouts) -> None:
        axis = self.model_axis
        heads = layer.num_heads
        if heads % n:
            return  # heads do not split over the axis: replicated
        projections = _keras_compat.attention_projections(layer)
        for name in ("query", "key", "value"):
            dense = projections.get(name)
            if dense is None:
                continue
            layouts[dense.kernel.path] = (None, axis, None)
            if getattr(dense, "bias", None) is not None:
                layouts[dense.bias.path] = (axis, None)
        output = projections.get("output")
        if output is not None:
            layouts[output.kernel.path] = (axis,) + (None,) * (len(output.kernel.shape) - 1)

    def _validate(self, path: str, shape: tuple, axes: Axes) -> None:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.shape))
        if len(axes) != len(shape):
            raise ValueError(
                f"Layout {tuple(axes)!r} for variable {path!r} has {len(axes)} "
                f"entries; the variable has shape {shape} (rank {len(shape)}). "
                "Give one mesh axis or None per dimension."
            )
        used = [a for a in axes if a is not None]
        if len(used) != len(set(used)):
            raise ValueError(
                f"Layout {tuple(axes)!r} for variable {path!r} uses a mesh axis "
                "twice; each mesh axis can shard at most one dimension."
            )
        for dim, (size, axis) in enumerate(zip(shape, axes)):
            if axis is None:
                continue
            if axis not in sizes:
                raise ValueError(
                    f"Layout {tuple(axes)!r} for variable {path!r} names "
                    f"{axis!r}, not an axis of the mesh {list(sizes)}."
                )
            if size % sizes[axis]:
                raise ValueError(
                    f"Variable {path!r} (shape {shape}): dimension {dim} of "
                    f"size {size} is not divisible by mesh axis {axis!r} of "
                    f"size {sizes[axis]}. Shard another dimension, replicate "
                    "this variable (a rule mapping it to None), or change the "
                    "layer size or the mesh."
                )


def _layers(model):
    if not isinstance(model, keras.layers.Layer):
        return [model]
    return list(_keras_compat.iter_sublayers(model))


def _variables(model) -> dict:
    if not model.built or not model.variables:
        raise ValueError(
            f"LayoutMapper needs a built model: {model.name!r} has no "
            "variables yet. Build it first (call it on a batch, or "
            "model.build(input_shape))."
        )
    return {v.path: v for v in model.weights}


_NORMALIZATIONS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
)


def _why_replicated(layer, variable, automatic, axis: str, n: int) -> str:
    """Why the automatic rules leave one of `layer`'s variables replicated.

    `automatic`: the automatic rules' layouts (before `min_elements` and
    `rules`).
    """
    if _is_conv(layer):
        return "convolution: DTensor runs it only replicated"
    if isinstance(layer, _NORMALIZATIONS):
        return "normalization layer"
    if isinstance(layer, keras.layers.MultiHeadAttention):
        if layer.num_heads % n:
            return f"{layer.num_heads} heads do not split over {axis}"
        return "added after the heads' all-reduce"
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and kernel.path in automatic:
            return "bias of a row-parallel layer (added after the all-reduce)"
        shape = tuple(variable.shape)
        return f"output dimension {shape[-1]} does not divide by {axis}"
    if isinstance(layer, keras.layers.Embedding):
        return f"the sharded dimension does not divide by {axis}"
    return "no rule for this layer type"


def convolution_variables(model) -> set[str]:
    """The paths of every convolution's variables in `model`.

    DTensor runs a convolution only with a fully replicated filter (its SPMD
    expander fails at the first step otherwise), and a bias sharded by
    channel after a replicated filter fails too ("SPMD expansion resulted
    in op output inconsistent with the provided layout", measured).
    """
    return {
        variable.path
        for layer in _layers(model)
        if _is_conv(layer)
        for variable in layer.weights
    }


_CONVOLUTIONS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)


def _is_conv(layer) -> bool:
    return isinstance(layer, _CONVOLUTIONS)
