"""
Title: Tensor model parallelism on TensorFlow with keras_dist.dtensor
Description: Shards a small attention classifier's layers over a 2 x 2 device
mesh (2-way data parallel x 2-way model parallel), trains it on the handwritten
digits shipped in examples/data, saves it, and loads it back re-sharded.

Run: `python examples/model_parallel.py` (add `--smoke` for a 2-epoch run).
On a CPU it splits the processor into 4 logical devices; on a machine with 4+
GPUs the same script shards over the first 4 GPUs instead.
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's graph cost estimator logs a harmless "Incompatible Matrix
# dimensions" error for DTensor's sharded matmuls; level 3 hides it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import keras_dist.dtensor as kd  # noqa: E402

# keras_dist: DTensor must set up its devices before TensorFlow starts: one
# call, first thing. On a CPU, `initialize(4)` splits it into 4 logical
# devices (listing physical devices does not start TensorFlow).
if tf.config.list_physical_devices("GPU"):
    DEVICE_TYPE, COUNT = "GPU", kd.initialize(device_type="GPU")
else:
    DEVICE_TYPE, COUNT = "CPU", kd.initialize(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _digits import load_digits  # noqa: E402 (examples/data, no download)


def build_model() -> keras.Model:
    # Each 8x8 digit is a sequence of 8 rows of 8 pixels.
    inputs = keras.Input((8, 8))
    h = keras.layers.Dense(32, name="embed")(inputs)
    attended = keras.layers.MultiHeadAttention(4, 8, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm")(h + attended)
    h = keras.layers.Dense(128, activation="relu", name="mlp_up")(h)
    h = keras.layers.Dense(32, name="mlp_down")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="classifier")(h)
    model = keras.Model(inputs, outputs, name="digits_attention")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main(smoke: bool) -> dict:
    # 1797 8x8 images of handwritten digits, shipped in examples/data.
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1440], y[:1440], x[1440:], y[1440:]

    # keras_dist: a mesh with named axes, in Keras' vocabulary (a
    # keras.distribution.DeviceMesh): "batch" splits each batch, "model"
    # splits the layers.
    devices = [f"{DEVICE_TYPE.lower()}:{i}" for i in range(4)]
    mesh = kd.make_mesh({"batch": 2, "model": 2}, devices)
    print(f"mesh: batch=2 x model=2 over {COUNT} {DEVICE_TYPE} devices")

    keras.utils.set_random_seed(0)
    model = build_model()

    # keras_dist: the LayoutMapper picks each variable's layout by layer type
    # (Megatron-style Dense pairs, attention heads); the classifier's 10
    # outputs would split too, but a rule keeps it replicated.
    mapper = kd.LayoutMapper(mesh, min_elements=256, rules={"classifier/.*": None})
    mapper.summary(model)

    # keras_dist: a sharded copy of the compiled model, itself a Keras model;
    # its variables and Adam slots live in shards, the batch is split over
    # "batch", and Keras' fit loop (callbacks, validation) drives it.
    sharded = kd.shard(model, mesh, mapper)
    history = sharded.fit(
        x_train, y_train, batch_size=64, epochs=2 if smoke else 12, shuffle=True,
        validation_split=0.1, verbose=0 if smoke else 2,
        callbacks=[keras.callbacks.EarlyStopping(patience=3, restore_best_weights=True)],
    ).history
    memory = sharded.bytes_per_device()
    print(
        f"bytes per device: variables {memory['variables']:,} of "
        f"{memory['replicated_variables']:,}, optimizer {memory['optimizer']:,} of "
        f"{memory['replicated_optimizer']:,}"
    )
    result = sharded.evaluate(x_test, y_test, batch_size=64, verbose=0, return_dict=True)
    print(f"first loss {history['loss'][0]:.4f}  last loss {history['loss'][-1]:.4f}")
    print(f"test loss {result['loss']:.4f}  test accuracy {result['accuracy']:.4f}")

    # keras_dist: saved gathered (a plain .keras file), loaded re-sharded,
    # here onto the same mesh; any other mesh works too.
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "digits_attention.keras")
        sharded.save(path)
        restored = kd.load_model(path, mesh, mapper)
        again = restored.evaluate(x_test, y_test, batch_size=64, verbose=0,
                                  return_dict=True)
    print(f"reloaded test accuracy {again['accuracy']:.4f}")
    return {"history": history, **result}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--smoke", action="store_true", help="two epochs")
    main(parser.parse_args().smoke)
