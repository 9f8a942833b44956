"""
Title: A distributed tf.data input pipeline
Description: Feeds a DistributedModel from a tf.data pipeline built the way
distributed training wants it (global batch = per-replica batch x replicas,
cache, seeded shuffle, prefetch, sharding under multi-worker), and measures
what cache + prefetch buy against the plain pipeline.

Run: `python examples/data_pipeline.py` (add `--smoke` for a short run), or
as 2 workers: `keras-dist launch --num-workers 2 examples/data_pipeline.py`.
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import keras_dist  # noqa: E402

if not tf.config.list_physical_devices("GPU") and not os.environ.get("TF_CONFIG"):
    keras_dist.simulate_replicas(2)

import keras  # noqa: E402
from _digits import load  # noqa: E402

PER_REPLICA_BATCH = 32


def augment(image, label):
    # Some per-example work, as real pipelines have (and parallelize).
    image = tf.image.random_brightness(image, 0.1, seed=1)
    return tf.clip_by_value(image, 0.0, 1.0), label


def pipeline(x, y, global_batch, tuned: bool, seed: int = 0) -> tf.data.Dataset:
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if tuned:
        dataset = dataset.cache()  # decode/read once, before the random parts
    # A seeded shuffle: under multi-worker training every worker draws the
    # same order and keeps its own share of each global batch.
    dataset = dataset.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE if tuned else None)
    # keras_dist: batch with the GLOBAL batch size; keras_dist splits every
    # batch over the replicas (and the workers). drop_remainder keeps every
    # batch the same shape (TPUs require it; GPUs and CPUs do not).
    dataset = dataset.batch(global_batch, drop_remainder=True)
    if tuned:
        dataset = dataset.prefetch(tf.data.AUTOTUNE)  # overlap input and training
    options = tf.data.Options()
    # Shard by data (each worker takes its share of every batch), the
    # policy that works for in-memory data; FILE suits many input files.
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def main(smoke: bool) -> dict:
    (x_train, y_train), (x_test, y_test) = load(images=True)
    strategy = keras_dist.resolve_strategy("auto")
    print(keras_dist.describe(strategy))
    # keras_dist: the global batch from the per-replica batch.
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    print(f"per-replica batch {PER_REPLICA_BATCH}, global batch {global_batch}")

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Dense(64, "relu")(h))
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(keras.optimizers.Adam(2e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])

    epochs = 2 if smoke else 8
    seconds = {}
    histories = {}
    for tuned in (False, True):
        train = pipeline(x_train, y_train, global_batch, tuned)
        start = time.perf_counter()
        histories[tuned] = model.fit(train, epochs=epochs if tuned else 1, verbose=0)
        seconds[tuned] = (time.perf_counter() - start) / (epochs if tuned else 1)
    print(f"seconds per epoch: plain pipeline {seconds[False]:.3f} (includes tracing), "
          f"cache + parallel map + prefetch {seconds[True]:.3f}")

    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    loss, accuracy = model.evaluate(test, verbose=0)
    history = histories[True].history["loss"]
    print(f"first loss {history[0]:.4f}  last loss {history[-1]:.4f}")
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="a short run")
    main(parser.parse_args().smoke)
