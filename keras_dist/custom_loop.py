"""`average_loss`: the per-replica loss of a custom training loop, exact on any split."""

from __future__ import annotations

import keras
import tensorflow as tf


def average_loss(per_example_loss, sample_weight=None, *, model: keras.Model | None = None):
    """This replica's share of the global mean loss, for `strategy.run` loops.

    In a custom loop each replica computes a loss whose gradients the
    optimizer sums across replicas, so each replica must return its share
    of the *global* mean: the sum of its per-example losses divided by the
    number of examples in the whole global batch. `tf.nn.compute_average_loss`
    divides by the per-replica batch times the replica count, which is wrong
    for a last batch that does not split evenly (e.g. 29 examples over 2
    replicas: 15 and 14) unless you pass the right size for every step.
    `average_loss` counts the global batch with one scalar all-reduce, so it
    is exact for every batch; with `model`, its regularization losses
    (`model.losses`) are added once in total (1/N per replica).

    Call it inside the function given to `strategy.run` (or outside any
    strategy, where it is the plain weighted mean).

    Args:
        per_example_loss: Tensor of per-example losses, first dimension the
            batch (a Keras loss with `reduction=None` gives one); extra
            dimensions are averaged, as Keras losses do.
        sample_weight: Optional tensor of per-example weights (shape
            `(batch,)`); the mean is then weighted (divided by the global sum
            of the weights).
        model: Optional `keras.Model` whose `losses` (regularization) are
            added.

    Returns:
        A scalar: this replica's share; summed over replicas it is the global
        mean loss (plus the regularization losses).

    Example:

        ```python
        loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras_dist.average_loss(loss_fn(y, model(x, training=True)),
                                               model=model)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        total = strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)
        ```

    Raises:
        ValueError: `per_example_loss` is a scalar (already reduced), or
            `sample_weight` does not match its batch dimension.
        RuntimeError: called in cross-replica context (outside
            `strategy.run` under a strategy).
    """
    loss = tf.convert_to_tensor(per_example_loss)
    if loss.shape.rank == 0:
        raise ValueError(
            "Argument `per_example_loss` must have a batch dimension; it is a "
            f"scalar. Received: per_example_loss={per_example_loss!r}. Build the "
            "Keras loss with reduction=None to get per-example losses."
        )
    if loss.shape.rank > 1:
        loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
    if sample_weight is None:
        weights = tf.ones_like(loss)
    else:
        weights = tf.cast(tf.convert_to_tensor(sample_weight), loss.dtype)
        if weights.shape.rank != 1 or (
            weights.shape[0] is not None
            and loss.shape[0] is not None
            and weights.shape[0] != loss.shape[0]
        ):
            raise ValueError(
                "Argument `sample_weight` must have shape (batch,) matching "
                f"per_example_loss's batch {loss.shape[0]}. Received: "
                f"sample_weight of shape {weights.shape}"
            )
    strategy = tf.distribute.get_strategy()
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
        raise RuntimeError(
            "average_loss() was called in cross-replica context. Call it inside "
            "the function you pass to strategy.run(), where each replica "
            "computes its loss."
        )
    local_sum = tf.reduce_sum(loss * weights)
    count = tf.reduce_sum(weights)
    replicas = strategy.num_replicas_in_sync
    if replicas > 1:
        count = tf.distribute.get_replica_context().all_reduce("SUM", count)
    result = tf.math.divide_no_nan(local_sum, count)
    if model is not None and model.losses:
        extra = tf.add_n([tf.cast(v, result.dtype) for v in model.losses])
        result = result + extra / float(replicas)
    return result
