"""Tensor (intra-layer) model parallelism on the TensorFlow backend.

`initialize` sets up DTensor's accelerator system (one call, before
TensorFlow starts), `make_mesh` builds a `keras.distribution.DeviceMesh`
with named axes, and `LayoutMapper` turns a model into a
`keras.distribution.LayoutMap`, Megatron-style, with validation and a
per-device memory summary. Keras' own vocabulary (`DeviceMesh`,
`TensorLayout`, `LayoutMap`) is used throughout, so a map means the same
thing on every backend.

`shard(model, mesh, layout_map)` (a preview) returns a `ShardedModel`, a
`keras.Model` trained by Keras' own fit loop on a copy of a compiled model
whose variables and optimizer slots are sharded `DVariable`s;
`shard(model, mesh, FullySharded())` splits every large variable and its
optimizer slots over the data-parallel axis instead (FSDP / ZeRO-3).
"""

from keras_dist.dtensor.fully_sharded import FullySharded
from keras_dist.dtensor.layout_mapper import LayoutMapper
from keras_dist.dtensor.mesh import initialize, make_mesh
from keras_dist.dtensor.sharded_model import ShardedModel, load_model, shard

__all__ = ["FullySharded", "LayoutMapper", "ShardedModel", "initialize", "load_model", "make_mesh", "shard"]
