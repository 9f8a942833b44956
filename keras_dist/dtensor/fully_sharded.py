"""`FullySharded`: fully sharded data parallelism (FSDP, ZeRO-3) on DTensor."""

from __future__ import annotations

import math
import numbers

import keras


class FullySharded:
    """Fully sharded data parallelism for any Keras model: pass it to `shard`.

    Every variable with at least `min_elements` elements is split over the
    mesh's data-parallel axis `axis` (its first dimension that divides by
    the axis' size), and so are its optimizer slots: each device holds
    about 1/N of the weights and optimizer state instead of all of it. The
    math is plain data parallelism: each step gathers the split variables
    (all-gather) before the forward pass, computes the gradients of the
    whole batch, and keeps each device's part of them (reduce-scatter)
    for an update of its own shard. Layers need no rule of their own:
    convolutions, embeddings and normalization layers run on the gathered
    values, as they would on one device.

        ```python
        mesh = keras_dist.dtensor.make_mesh({"batch": 4})
        sharded = keras_dist.dtensor.shard(model, mesh, keras_dist.dtensor.FullySharded())
        sharded.bytes_per_device()  # about a quarter of the replicated bytes
        ```

    Args:
        min_elements: Non-negative integer, default 1024: smaller variables
            (biases, normalization scales) stay replicated: splitting them
            saves little and costs one gather each.
        axis: Name of the mesh axis the batch is split over, default
            `"batch"`; the mesh must have it.

    Variables with no dimension that divides by the axis' size stay
    replicated; `layouts(model, mesh)` says where each variable goes.
    """

    def __init__(self, min_elements: int = 1024, axis: str = "batch"):
        if (not isinstance(min_elements, numbers.Integral) or isinstance(min_elements, bool)
                or min_elements < 0):
            raise ValueError(
                "Argument `min_elements` must be a non-negative integer (variables "
                f"with fewer elements stay replicated). Received: min_elements={min_elements!r}"
            )
        if not isinstance(axis, str) or not axis:
            raise ValueError(
                "Argument `axis` must be the name of the mesh axis the batch is "
                f"split over, e.g. \"batch\". Received: axis={axis!r}"
            )
        self.min_elements = int(min_elements)
        self.axis = axis

    def __repr__(self) -> str:
        return f"FullySharded(min_elements={self.min_elements}, axis={self.axis!r})"

    def layouts(self, model: keras.Model, mesh: keras.distribution.DeviceMesh) -> dict:
        """{variable path: axes} for `model`'s variables on `mesh`: the axis
        at the first dimension that divides, None elsewhere; variables left
        out of the dict stay replicated."""
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"FullySharded splits variables over the mesh axis {self.axis!r}, "
                f"which the mesh does not have (its axes: {list(mesh.axis_names)}). "
                f"Pass FullySharded(axis=...) with one of them, or make the mesh "
                f"with a {self.axis!r} axis."
            )
        size = dict(zip(mesh.axis_names, mesh.shape))[self.axis]
        found = {}
        for variable in model.weights:
            shape = tuple(variable.shape)
            if size == 1 or math.prod(shape) < max(self.min_elements, 1):
                continue
            for dim, extent in enumerate(shape):
                if extent % size == 0:
                    found[variable.path] = tuple(
                        self.axis if d == dim else None for d in range(len(shape)))
                    break
        return found
