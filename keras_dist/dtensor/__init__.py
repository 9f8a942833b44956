"""Tensor (intra-layer) model parallelism on the TensorFlow backend.

`initialize` sets up DTensor's accelerator system (one call, before
TensorFlow starts), `make_mesh` builds a `keras.distribution.DeviceMesh`
with named axes, and `LayoutMapper` turns a model into a
`keras.distribution.LayoutMap`, Megatron-style, with validation and a
per-device memory summary. Keras' own vocabulary (`DeviceMesh`,
`TensorLayout`, `LayoutMap`) is used throughout, so a map means the same
thing on every backend.

Training with the map (sharded `DVariable`s) is not available yet.
"""

from keras_dist.dtensor.layout_mapper import LayoutMapper
from keras_dist.dtensor.mesh import initialize, make_mesh

__all__ = ["LayoutMapper", "initialize", "make_mesh"]
