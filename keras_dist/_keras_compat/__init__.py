"""Every touch point of keras_dist on Keras and TensorFlow internals.

No other module reads or writes a private Keras/TF attribute or imports
`keras.src` (tests/test_keras_compat.py enforces it, and pins each symbol
listed in `INTERNALS` and `OVERRIDDEN`). This package is the one door: the
rest of keras_dist imports `keras_dist._keras_compat` and reads its names.
Its modules, one concept each, laid out like Keras' own
`backend/tensorflow/`, each with the private symbols it uses (`INTERNALS`)
beside its code:

- `distribute`: strategies, per-replica values and their reduction;
- `runtime`: TensorFlow's runtime in a task of a multi-worker job;
- `trainer`: Keras' TensorFlow trainer (the symbolic build, step accessors);
- `layers`: BatchNorm moments, replica-invariant dropout, layer traversal;
- `callbacks`: callback state, the start epoch, the global seed state;
- `iterators`: Keras' epoch iterators, lazy and released off-thread;
- `variables`: moving a model's variables and optimizer onto a strategy.

Keras 3's TensorFlow trainer (`keras/src/backend/tensorflow/trainer.py`) has
bugs that break distributed training; the fixes below replace the affected
pieces for `DistributedModel` only. One touches a Keras class: while one
`fit`, `evaluate` or `predict` runs, `iterators.lean_epoch_iterators`
replaces `TFEpochIterator.__init__` (and puts it back when the call
returns or raises); every other fix acts on keras_dist's own objects or on
the one model or strategy it is given:

1. `_maybe_symbolic_build` reduces the first batch with
   `strategy.reduce("MEAN", <nest>)`, which `MultiWorkerMirroredStrategy`
   rejects ("Attempt to convert a value (PerReplica...) to a Tensor").
   Only shapes are needed, so replica 0's local batch is used instead.
2. `reduce_per_replica` reduces scalar logs with `axis=0` under
   `MultiWorkerMirroredStrategy` ("Invalid reduction dimension 0").
   Logs are reduced with `axis=None`.
3. The `steps_per_execution > 1` loop fails with more than one replica
   ("You must feed a value for placeholder tensor", keras-team/keras#19246).
   The loop below takes the first step unconditionally and the following
   ones through `get_next_as_optional` inside an autograph `for` loop.
4. `predict` under `MultiWorkerMirroredStrategy` gathers outputs with a
   collective that rejects bfloat16/float16 (mixed precision): they are
   gathered as float32 and cast back.
5. `LossScaleOptimizer` (mixed_float16) skips or applies a step from each
   replica's local gradients; replicas are made to agree (see
   `agree_on_finite`), which also keeps MultiWorkerMirroredStrategy from
   hanging.
6. `BackupAndRestore` resumes an interrupted run: it sets the epoch Keras'
   fit starts from (`model._initial_epoch`, read after `on_train_begin`),
   saves Keras' global SeedGenerator, and counts the iterators fit creates
   on the training input (`TFEpochIterator`) so that a seeded shuffle is
   positioned exactly.
7. `_get_metrics_result_or_logs` logs the model's metrics (read across
   replicas) at an epoch's end only when the step's logs have the same
   keys; a custom `train_step` that returns `{m.name: m.result() for m in
   self.metrics}` (Keras' guide) returns the compiled metrics nested under
   `compile_metrics`, so the keys differ and Keras logs the last step's
   per-replica results, averaged over the replicas: not the epoch's value
   when the replicas' shares of a batch differ. The keys are compared
   flattened, as Keras flattens the logs it shows.

Tested against the Keras versions in `TESTED_KERAS_VERSIONS`.
"""

from __future__ import annotations

import warnings

import keras

from keras_dist._keras_compat import callbacks as _callbacks
from keras_dist._keras_compat import distribute as _distribute
from keras_dist._keras_compat import iterators as _iterators
from keras_dist._keras_compat import layers as _layers
from keras_dist._keras_compat import runtime as _runtime
from keras_dist._keras_compat import trainer as _trainer
from keras_dist._keras_compat import variables as _variables
from keras_dist._keras_compat.callbacks import (  # noqa: F401 (the one door)
    KERAS_CALLBACK_STATE,
    global_seed_variables,
    keras_backup_paths,
    keras_backup_paths_in,
    keras_metrics_only,
    learning_rate_variable,
    set_initial_epoch,
    set_keras_backup_paths,
    set_learning_rate_variable,
)
from keras_dist._keras_compat.distribute import (  # noqa: F401 (the one door)
    cross_replica_updates,
    first_replica_batch,
    in_multi_worker_mode,
    mirrored_strategy,
    reduce_per_replica,
    set_model_strategy,
)
from keras_dist._keras_compat.iterators import (  # noqa: F401 (the one door)
    keras_shuffle_order,
    lean_epoch_iterators,
    materialize,
    reorders_each_pass,
    tensorflow_global_seed,
    wait_for_released_iterators,
    without_global_seed,
)
from keras_dist._keras_compat.layers import (  # noqa: F401 (the one door)
    NOISE_LAYERS,
    attention_projections,
    clone_layer,
    iter_sublayers,
    replica_invariant_dropout,
    replica_invariant_noise,
    rows_start_at,
    synchronize_batch_norm,
)
from keras_dist._keras_compat.runtime import (  # noqa: F401 (the one door)
    KeyExists,
    abort_collectives,
    configure_collectives,
    eager_runtime_started,
    forget_collectives,
    join_cluster_at_startup,
    key_store_available,
    set_key,
    wait_for_key,
)
from keras_dist._keras_compat.trainer import (  # noqa: F401 (the one door)
    Functional,
    autoconvert_optionals,
    call_has_training_arg,
    compute_loss,
    concat,
    functional_init_arguments,
    logits_of,
    loss_tracker,
    symbolic_build,
    unscale_loss_for_distribution,
    with_logits,
)
from keras_dist._keras_compat.variables import (  # noqa: F401 (the one door)
    alias_registered_name,
    host_counter,
    move_onto,
    move_variables,
    on_strategy,
    optimizer_keys,
    optimizer_on_strategy,
    optimizer_variables,
    optimizers_of,
    rekey_optimizers,
    restore_unreadable,
    set_optimizer_strategy,
    snapshot,
    unique_variables,
)

TESTED_KERAS_VERSIONS = ("3.15",)

if not keras.__version__.startswith(TESTED_KERAS_VERSIONS):  # pragma: no cover
    warnings.warn(
        f"keras_dist is tested with Keras {', '.join(TESTED_KERAS_VERSIONS)}; "
        f"found Keras {keras.__version__}. Distributed training may misbehave.",
        stacklevel=2,
    )


# -- what the tests pin ---------------------------------------------------------


def _merged_pins(*tables: dict) -> dict:
    merged: dict = {}
    for table in tables:
        for owner, names in table.items():
            merged[owner] = tuple(sorted(set(merged.get(owner, ())) | set(names)))
    return merged


OVERRIDDEN = {
    "_maybe_symbolic_build": ("keras.Model",),
    "_get_metrics_result_or_logs": ("keras.Model",),
}
"""Private Keras methods keras_dist's classes override (name: owners)."""

INTERNALS = _merged_pins(
    _callbacks.INTERNALS, _distribute.INTERNALS, _iterators.INTERNALS, _layers.INTERNALS,
    _runtime.INTERNALS, _trainer.INTERNALS, _variables.INTERNALS,
)
"""Every private Keras/TF symbol the modules of this package use, by owner
(each module lists its own, beside its code), for the test that pins them: a dotted path (module or class), a path with " (source)" (the names
occur in its source: attributes Keras sets and reads itself) or a built
object described in the test."""
