"""Differential parity cases: each `keras.Model` feature as users write it.

Every case builds a model with no seed, the way Keras users write one
(layers called on `keras.Input` before any keras_dist call, custom layers
without `get_config`, `Lambda`, dict and nested I/O, subclassed models with
arbitrary constructor arguments, built-in callbacks), then trains,
evaluates and predicts. `run_case` runs it twice from the same initial
weights: once as plain Keras on one device, once through
`keras_dist.distribute` / `keras_dist.DistributedModel` on a strategy, and
returns both results for an exact comparison (`compare`).

Used in-process on 2 replicas (tests/test_parity.py) and by each worker of
a 2-worker job (tests/multi_worker/parity_main.py).
"""

from __future__ import annotations

import os
import random
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_dist

N, BATCH, D = 64, 16, 4
TOL = 1e-5
# The weights of a model trained by float32 Adam: Adam divides each gradient
# entry by its own running magnitude, so an entry whose batch terms nearly
# cancel carries its summation-order rounding (2 replicas add in another
# order than one device) into its update at the scale of the learning rate.
# Measured: 4e-7 in 15 runs of 15, 1.16e-5 once (6 updates at 0.01). Wrong
# training (a step skipped or repeated, a replica's gradient lost, another
# batch) moves them by orders of magnitude more; every logged number and
# prediction, and every other optimizer's weights, keep TOL.
TOL_ADAM_WEIGHTS = 1e-4
ADAM_FAMILY = ("Adam", "AdamW", "Adamax", "Nadam", "Lamb")
# Cases refused under multi-worker training, before any step, with the
# message part given (see docs/parity.md).
REFUSED_ON_WORKERS = {"optional_input": "`None` for an optional input is not supported"}


def data(n=N, d=D, classes=None):
    """Deterministic, learnable data (no random generator involved)."""
    t = np.arange(n * d, dtype="float64").reshape(n, d)
    x = (np.sin(0.37 * t) + 0.5 * np.cos(0.11 * t)).astype("float32")
    y = (x @ np.linspace(-1.0, 1.0, d)[:, None] + 0.1).astype("float32")
    if classes:
        return x, (np.abs(np.floor(y[:, 0] * 3.0)) % classes).astype("int32")
    return x, y


def mlp_layers(inputs, units=8):
    h = keras.layers.Dense(units, activation="relu")(inputs)
    return keras.layers.Dense(1)(h)


def functional_mlp(kd=None):
    """A functional MLP, built with plain Keras (`kd` is ignored)."""
    inputs = keras.Input((D,))
    return keras.Model(inputs, mlp_layers(inputs))


class Scale(keras.layers.Layer):
    """A custom layer without `get_config`, taking a non-serializable argument."""

    def __init__(self, units, transform, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.transform = transform

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units))
        self.b = self.add_weight(shape=(self.units,), initializer="zeros")

    def call(self, x):
        return self.transform(x @ self.w + self.b)


class Tower(keras.Model):
    """A subclassed model whose constructor takes a Python object."""

    def __init__(self, head, activation=tf.nn.tanh):
        super().__init__()
        self.head = head
        self.activation = activation
        self.hidden = keras.layers.Dense(8)

    def call(self, x):
        return self.head(self.activation(self.hidden(x)))


class CustomFit(keras.Model):
    """Keras' "customizing what happens in fit()" guide, used functionally."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


def history(h):
    return {f"history/{k}": np.asarray(v, "float64") for k, v in h.history.items()}


def fit_eval_predict(model, x, y, fit_x=None, fit_y=None, **fit_kwargs):
    fit_kwargs.setdefault("epochs", 2)
    fit_kwargs.setdefault("verbose", 0)
    fit_kwargs.setdefault("shuffle", False)
    if "batch_size" not in fit_kwargs and not isinstance(
        fit_x, (tf.data.Dataset, keras.utils.PyDataset)
    ):
        fit_kwargs["batch_size"] = BATCH
    h = model.fit(x if fit_x is None else fit_x,
                  y if fit_x is None else fit_y, **fit_kwargs)
    out = history(h)
    out["evaluate"] = np.asarray(
        model.evaluate(x, y, batch_size=BATCH, verbose=0), "float64"
    )
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    for i, p in enumerate(tf.nest.flatten(predictions)):
        out[f"predict/{i}"] = np.asarray(p)
    out["predict/structure"] = np.asarray(type(predictions).__name__)
    if isinstance(predictions, dict):
        out["predict/keys"] = np.asarray(sorted(predictions))
    return out


# -- the cases ----------------------------------------------------------------
# Each: build(kd) -> model (kd: the functional form may be DistributedModel),
# train(model) -> {name: array}.

CASES = {}


def case(name, row):
    def register(fn):
        CASES[name] = (fn, row)
        return fn

    return register


@case("numpy", "numpy input, `evaluate`, `predict`")
def _numpy():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        out = fit_eval_predict(model, x, y)
        # Any batch size evaluates and predicts (7 and 5 split 4/3 and 3/2).
        out["evaluate_batch_7"] = np.asarray(model.evaluate(x, y, batch_size=7, verbose=0))
        out["predict_batch_5"] = np.asarray(model.predict(x, batch_size=5, verbose=0))
        return out

    return build, train


@case("dropout", "`Dropout` (per element, with a `noise_shape`, spatial), seeded layers: the same masks as one device")
def _dropout():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Reshape((4, 4))(h)
        h = keras.layers.SpatialDropout1D(0.25, seed=10)(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dropout(0.4, seed=11)(h)
        h = keras.layers.Dense(8, activation="relu")(h)
        h = keras.layers.Dropout(0.3, noise_shape=(None, 8), seed=12)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("noise_layers", "`GaussianNoise`, `GaussianDropout`, `AlphaDropout` (with a "
      "`noise_shape`): the same noise as one device")
def _noise_layers():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.GaussianNoise(0.1, seed=20)(inputs)
        h = keras.layers.Dense(16, activation="selu")(h)
        h = keras.layers.AlphaDropout(0.2, seed=21)(h)
        h = keras.layers.GaussianDropout(0.3, seed=22)(h)
        h = keras.layers.Dense(8, activation="selu")(h)
        h = keras.layers.AlphaDropout(0.1, noise_shape=(None, 1), seed=23)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    def train(model):
        model.compile(keras.optimizers.SGD(0.02, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        return fit_eval_predict(model, x, y, validation_split=0.25, epochs=3)

    return build, train


@case("functional_form", "`DistributedModel(inputs, outputs)` on layers built first")
def _functional_form():
    def build(kd):
        inputs = keras.Input((D,))
        outputs = mlp_layers(inputs)
        if kd:
            return keras_dist.DistributedModel(inputs, outputs, strategy=kd)
        return keras.Model(inputs, outputs)

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case(
    "made_before_the_model",
    "script order of the tutorials: a `tf.data` pipeline, a `Normalization` "
    "adapted on data, a variable, a tensor and a `tf.function` made before the "
    "model (and, in the 2-worker job, before the strategy)",
)
def _made_before_the_model():
    made = {}

    def build(kd):
        x, y = data()
        offset = tf.Variable(0.25)
        scale = tf.constant(0.5, "float32")

        @tf.function
        def prepare(features, target):
            return features * scale + offset, target

        made["dataset"] = tf.data.Dataset.from_tensor_slices((x, y)).map(prepare).batch(BATCH)
        made["x"] = x * 0.5 + 0.25
        normalize = keras.layers.Normalization()
        normalize.adapt(made["x"])
        inputs = keras.Input((D,))
        outputs = mlp_layers(normalize(inputs))
        if kd:
            return keras_dist.DistributedModel(inputs, outputs, strategy=kd)
        return keras.Model(inputs, outputs)

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        return fit_eval_predict(model, made["x"], data()[1], fit_x=made["dataset"])

    return build, train


def _accumulating(optimizer: str, batch_norm: bool):
    """An optimizer's own `gradient_accumulation_steps=2` (Keras 3): plain
    Keras trains it on one device and fails on any `MirroredStrategy`."""

    def make():
        def build(kd):
            layers = [keras.Input((D,)), keras.layers.Dense(8, activation="relu")]
            if batch_norm:
                layers.append(keras.layers.BatchNormalization())
            return keras.Sequential(layers + [keras.layers.Dense(1)])

        def train(model):
            if optimizer == "sgd":
                opt = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2)
            else:
                opt = keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
            model.compile(opt, "mse", metrics=["mae"])
            x, y = data()
            return fit_eval_predict(model, x, y, validation_split=0.25, epochs=3)

        return build, train

    return make


for _optimizer in ("sgd", "adam"):
    for _batch_norm in (False, True):
        _name = f"gradient_accumulation_{_optimizer}" + ("_batch_norm" if _batch_norm else "")
        CASES[_name] = (
            _accumulating(_optimizer, _batch_norm),
            f"`gradient_accumulation_steps=2`, {'SGD momentum' if _optimizer == 'sgd' else 'Adam'}"
            + (", `BatchNormalization`" if _batch_norm else ""),
        )


class _Optional(keras.layers.Layer):
    def call(self, a, b=None):
        return a if b is None else a + b


@case("optional_input", "`None` for an optional input in a dict of inputs")
def _optional_input():
    def build(kd):
        a = keras.Input((D,), name="a")
        b = keras.Input((D,), name="b", optional=True)
        return keras.Model({"a": a, "b": b}, mlp_layers(_Optional()(a, b)))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        return fit_eval_predict(model, {"a": x, "b": None}, y)

    return build, train


@case("scipy_sparse", "SciPy sparse matrix input (`keras.Input(sparse=True)`)")
def _scipy_sparse():
    import scipy.sparse

    def build(kd):
        inputs = keras.Input((D,), sparse=True)
        return keras.Model(inputs, keras.layers.Dense(1)(inputs))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        x = scipy.sparse.csr_matrix(np.where(np.abs(x) > 0.5, x, 0.0).astype("float32"))
        return fit_eval_predict(model, x, y)

    return build, train


@case("dict_io", "dict inputs and outputs; loss, loss-weight and metric dicts")
def _dict_io():
    def build(kd):
        a = keras.Input((2,), name="a")
        b = keras.Input((2,), name="b")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        return keras.Model(
            {"a": a, "b": b},
            {"value": keras.layers.Dense(1, name="value")(h),
             "label": keras.layers.Dense(3, activation="softmax", name="label")(h)},
        )

    def train(model):
        model.compile(
            keras.optimizers.Adam(0.01),
            loss={"value": "mse", "label": "sparse_categorical_crossentropy"},
            loss_weights={"value": 1.0, "label": 0.5},
            metrics={"value": ["mae"], "label": ["accuracy"]},
        )
        x, y = data()
        _, label = data(classes=3)
        xs = {"a": x[:, :2], "b": x[:, 2:]}
        return fit_eval_predict(model, xs, {"value": y, "label": label})

    return build, train


@case("nested_io", "nested (list) inputs and outputs given as Python lists")
def _nested_io():
    def build(kd):
        a, b = keras.Input((2,)), keras.Input((2,))
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Add()([a, b]))
        return keras.Model([a, b], [keras.layers.Dense(1, name="first")(h),
                                    keras.layers.Dense(1, name="second")(h)])

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), ["mse", "mae"])
        x, y = data()
        return fit_eval_predict(model, [x[:, :2], x[:, 2:]], [y, 2.0 * y])

    return build, train


@case("tf_data", "`tf.data.Dataset` input")
def _tf_data():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        return fit_eval_predict(model, x, y, fit_x=ds, fit_y=None)

    return build, train


@case("seeded_reshuffle", "a `tf.data` pipeline that reshuffles each pass with a seed "
      "(`shuffle(seed=...)`, `sample_from_datasets(seed=...)`), for training "
      "and validation, over two `fit` calls: the same order every epoch as "
      "one device")
def _seeded_reshuffle():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=7).batch(BATCH)
        mixed = tf.data.Dataset.sample_from_datasets(
            [tf.data.Dataset.from_tensor_slices((x[:32], y[:32])),
             tf.data.Dataset.from_tensor_slices((x[32:], y[32:]))],
            seed=3, rerandomize_each_iteration=True,
        ).batch(BATCH)
        val = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).shuffle(
            40, seed=5).batch(8)
        out = fit_eval_predict(model, x, y, fit_x=ds, fit_y=None, epochs=3,
                               validation_data=val)
        h = model.fit(ds, epochs=2, verbose=0)
        out.update({f"second/{k}": v for k, v in history(h).items()})
        h = model.fit(mixed, epochs=3, verbose=0)
        out.update({f"mixed/{k}": v for k, v in history(h).items()})
        return out

    return build, train


@case("seeded_shuffle", "`keras.utils.set_random_seed` then `fit` with its default "
      "`shuffle=True` (and `validation_split`, two `fit` calls): Keras' own order, "
      "and the random draws after it (Python, NumPy, TensorFlow, `keras.random`) "
      "as one device leaves them")
def _seeded_shuffle():
    build = functional_mlp

    def train(model):
        keras.utils.set_random_seed(1234)
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        h = model.fit(x, y, batch_size=BATCH, epochs=3, validation_split=0.25, verbose=0)
        out = history(h)
        h = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        out.update({f"second/{k}": v for k, v in history(h).items()})
        out["evaluate"] = np.asarray(model.evaluate(x, y, batch_size=BATCH, verbose=0))
        out["predict/0"] = np.asarray(model.predict(x, batch_size=BATCH, verbose=0))
        out["draws/python"] = np.asarray(random.random())
        out["draws/numpy"] = np.asarray(np.random.rand(3))
        out["draws/tensorflow"] = np.asarray(tf.random.uniform([3]))
        out["draws/keras"] = np.asarray(keras.random.uniform([3]))
        return out

    return build, train


@case("shuffled_validation", "shuffled arrays with `validation_data`, a loss summed per batch")
def _shuffled_validation():
    build = functional_mlp

    def train(model):
        # A summed loss logs per-batch sums averaged over the batches: the
        # validation number depends on how the validation data is batched
        # (fit's batch_size, or validation_batch_size).
        keras.utils.set_random_seed(99)
        model.compile(keras.optimizers.SGD(0.002),
                      keras.losses.MeanSquaredError(reduction="sum"), metrics=["mae"])
        x, y = data()
        h = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                      validation_data=(x[:40], y[:40]))
        out = history(h)
        h = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_split=0.3)
        out.update({f"second/{k}": v for k, v in history(h).items()})
        h = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      validation_data=(x[:40], y[:40]), validation_batch_size=24)
        out.update({f"third/{k}": v for k, v in history(h).items()})
        out["evaluate"] = np.asarray(model.evaluate(x, y, batch_size=BATCH, verbose=0))
        return out

    return build, train


@case("py_dataset", "`keras.utils.PyDataset` input")
def _py_dataset():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y, fit_x=Batches(x, y, BATCH), fit_y=None)

    return build, train


@case("generator", "Python generator input with `steps_per_epoch`")
def _generator():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()

        def batches():
            while True:
                for i in range(0, N, BATCH):
                    yield x[i:i + BATCH], y[i:i + BATCH]  # views, as users write

        out = fit_eval_predict(model, x, y, fit_x=batches(), fit_y=None,
                               steps_per_epoch=N // BATCH)
        out["iterations"] = np.asarray(int(model.optimizer.iterations.numpy()))
        return out

    return build, train


@case("sample_weight", "`sample_weight`")
def _sample_weight():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse", weighted_metrics=["mae"])
        x, y = data()
        weights = np.linspace(0.1, 2.0, N).astype("float32")
        return fit_eval_predict(model, x, y, sample_weight=weights)

    return build, train


@case("class_weight", "`class_weight`")
def _class_weight():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        x, label = data(classes=3)
        return fit_eval_predict(model, x, label, class_weight={0: 1.0, 1: 2.0, 2: 0.5})

    return build, train


@case("validation", "`validation_split`, `validation_data`, `validation_freq`")
def _validation():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        x, y = data()
        out = fit_eval_predict(model, x, y, validation_split=0.25, epochs=3,
                               validation_freq=2)
        h = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                      validation_data=(x[:32], y[:32]), validation_batch_size=8)
        out.update({f"second/{k}": v for k, v in history(h).items()})
        return out

    return build, train


@case("epochs_and_steps", "`initial_epoch`, `steps_per_epoch` on a repeated dataset")
def _epochs_and_steps():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
        out = fit_eval_predict(model, x, y, fit_x=ds, fit_y=None, epochs=3,
                               initial_epoch=1, steps_per_epoch=3)
        out["iterations"] = np.asarray(int(model.optimizer.iterations.numpy()))
        return out

    return build, train


@case("on_batch", "`train_on_batch`, `test_on_batch`, `predict_on_batch`")
def _on_batch():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        x, y = data()
        out = {}
        for i in range(0, N, BATCH):
            out[f"train/{i}"] = np.asarray(model.train_on_batch(x[i:i + BATCH], y[i:i + BATCH]))
        out["test"] = np.asarray(model.test_on_batch(x[:BATCH], y[:BATCH]))
        out["predict"] = np.asarray(model.predict_on_batch(x[:BATCH]))
        out["predict_5_rows"] = np.asarray(model.predict_on_batch(x[:5]))  # split 3 and 2
        return out

    return build, train


@case("custom_layer", "custom layer without `get_config`, non-serializable argument")
def _custom_layer():
    def build(kd):
        inputs = keras.Input((D,))
        h = Scale(8, tf.nn.relu)(inputs)
        return keras.Model(inputs, Scale(1, lambda t: t)(h))

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("lambda", "`Lambda` layers")
def _lambda():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.Lambda(lambda t: tf.concat([t, t * t], axis=-1))(inputs)
        return keras.Model(inputs, mlp_layers(h))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("nested_model", "nested models (a Sequential inside a functional model)")
def _nested_model():
    def build(kd):
        inner = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(4)])
        inputs = keras.Input((D,))
        return keras.Model(inputs, keras.layers.Dense(1)(inner(inputs)))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("subclassed", "subclassed model, non-serializable constructor arguments")
def _subclassed():
    def build(kd):
        model = Tower(keras.layers.Dense(1), activation=lambda t: tf.nn.tanh(t))
        model(data()[0][:2])
        return model

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("custom_train_step", "custom `train_step`, model subclass used functionally")
def _custom_train_step():
    def build(kd):
        inputs = keras.Input((D,))
        return CustomFit(inputs, mlp_layers(inputs))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("sequential_batch_norm", "Sequential with BatchNormalization")
def _sequential_batch_norm():
    def build(kd):
        return keras.Sequential([
            keras.Input((D,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"), keras.layers.Dense(1),
        ])

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data()
        return fit_eval_predict(model, x, y)

    return build, train


@case("uneven_last_batch", "uneven last batch (69 samples, batch 16: 3 and 2 rows on "
      "2 replicas), with `Dropout` and `GaussianNoise`")
def _uneven_last_batch():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dropout(0.3, seed=30)(h)
        h = keras.layers.GaussianNoise(0.2, seed=31)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05), "mse")
        x, y = data(n=69)
        return fit_eval_predict(model, x, y)

    return build, train


@case("indivisible_batch", "a `batch_size` the replicas do not divide (15 on 2: 8 and 7 "
      "rows every step; a `tf.data` pipeline batched by 9), with `BatchNormalization` "
      "and `Dropout`")
def _indivisible_batch():
    def build(kd):
        inputs = keras.Input((D,))
        h = keras.layers.Dense(16)(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.Dropout(0.3, seed=40)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    def train(model):
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        x, y = data()
        out = fit_eval_predict(model, x, y, batch_size=15, validation_split=0.25)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(9)
        out.update({f"dataset/{k}": v for k, v in history(model.fit(
            ds, epochs=2, validation_data=ds, verbose=0)).items()})
        return out

    return build, train


@case("compiled_first", "model compiled and trained before `distribute()`")
def _compiled_first():
    def build(kd):
        inputs = keras.Input((D,))
        model = keras.Model(inputs, mlp_layers(inputs))
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        return model

    def train(model):
        x, y = data()
        out = fit_eval_predict(model, x, y)
        out["iterations"] = np.asarray(int(model.optimizer.iterations.numpy()))
        return out

    return build, train


@case("callbacks", "EarlyStopping(restore_best_weights), ModelCheckpoint, "
      "ReduceLROnPlateau, CSVLogger, TensorBoard, TerminateOnNaN, LearningRateScheduler, "
      "Keras' BackupAndRestore, RemoteMonitor: the files and requests one process leaves")
def _callbacks():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.SGD(0.2, momentum=0.9), "mse")
        x, y = data()
        # As a user writes it: the same paths on every worker.
        work = shared_dir("callbacks")
        best = os.path.join(work, "best.keras")
        callbacks = [
            keras.callbacks.EarlyStopping("val_loss", patience=1, restore_best_weights=True),
            keras.callbacks.ModelCheckpoint(best, save_best_only=True),
            keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=0),
            keras.callbacks.CSVLogger(os.path.join(work, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(work, "tb")),
            keras.callbacks.TerminateOnNaN(),
            keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.9),
            keras.callbacks.BackupAndRestore(os.path.join(work, "backup")),
            # A user's subclasses: they run on every worker (they may do
            # more than write), and still leave one process's files.
            LearningRateCSV(os.path.join(work, "lr.csv")),
            LearningRateBoard(os.path.join(work, "tb_lr")),
        ]
        remote = os.environ.get("PARITY_REMOTE_MONITOR")
        if remote:
            callbacks.append(keras.callbacks.RemoteMonitor(
                root=remote, path=f"/{_mode['name']}/{os.getpid()}"
            ))
        out = fit_eval_predict(model, x, y, epochs=8, validation_data=(x, y),
                               callbacks=callbacks)
        loaded = keras.models.load_model(best)
        out["checkpoint/predict"] = np.asarray(loaded.predict(x, batch_size=BATCH, verbose=0))
        # What the job left (read after evaluate and predict, which every
        # worker only finishes once the chief's fit has closed its files).
        out.update(files_left(work))
        return out

    return build, train


def _with_learning_rate(model, logs):
    rate = model.optimizer.learning_rate
    return dict(logs or {}, rate_seen=float(keras.ops.convert_to_numpy(rate)))


class LearningRateCSV(keras.callbacks.CSVLogger):
    """A user's CSVLogger that also logs the learning rate it saw."""

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _with_learning_rate(self.model, logs))


class LearningRateBoard(keras.callbacks.TensorBoard):
    """A user's TensorBoard that also logs the learning rate it saw."""

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _with_learning_rate(self.model, logs))


def files_left(work: str) -> dict:
    """The files a run left in `work`, as comparable values: the tree (event
    files counted per directory), the CSV's columns and numbers, and every
    TensorBoard scalar by run, tag and step."""
    out, tree = {}, []
    for root, _, names in sorted(os.walk(work)):
        where = os.path.relpath(root, work)
        events = [n for n in names if n.startswith("events.out.tfevents")]
        tree += [f"{where}/{n}" for n in sorted(names) if n not in events]
        if events:
            tree.append(f"{where}/<{len(events)} event file(s)>")
        for name in events:
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                for value in event.summary.value:
                    if value.metadata.plugin_data.plugin_name != "scalars":
                        continue  # the model's graph and config
                    key = f"tensorboard/{where}/{value.tag}"
                    number = float(tf.make_ndarray(value.tensor)) if value.HasField(
                        "tensor") else value.simple_value
                    out.setdefault(key, []).append((event.step, number))
    out = {k: np.asarray(sorted(v), "float64") for k, v in out.items()}
    out["files"] = np.asarray(tree)
    for name, key in (("log.csv", "csv"), ("lr.csv", "csv_lr")):
        with open(os.path.join(work, name)) as f:
            header, *rows = f.read().strip().splitlines()
        out[f"{key}/columns"] = np.asarray(header.split(","))
        out[f"{key}/values"] = np.asarray([[float(v) for v in r.split(",")] for r in rows])
    return out


@case("save_load", "`.keras` save / load, `save_weights` / `load_weights`")
def _save_load():
    build = functional_mlp

    def train(model):
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = data()
        out = fit_eval_predict(model, x, y)
        work = shared_dir("save_load")
        path = os.path.join(work, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        loaded.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        out["loaded/predict"] = np.asarray(loaded.predict(x, batch_size=BATCH, verbose=0))
        model.save_weights(os.path.join(work, "w.weights.h5"))
        model.load_weights(os.path.join(work, "w.weights.h5"))
        out["reloaded/predict"] = np.asarray(model.predict(x, batch_size=BATCH, verbose=0))
        return out

    return build, train


# -- running and comparing ----------------------------------------------------

_mode = {"name": "plain", "base": None}


def shared_dir(case_name: str) -> str:
    """Where a case saves files a model reloads: shared by the workers of a
    keras_dist run (only the chief's files are kept), private otherwise."""
    if _mode["base"] is None:
        _mode["base"] = os.environ.get("PARITY_WORKDIR") or tempfile.mkdtemp(
            prefix="parity_"
        )
    own = "" if _mode["name"] == "keras_dist" else f"-{os.getpid()}"
    path = os.path.join(_mode["base"], f"{_mode['name']}{own}", case_name)
    os.makedirs(path, exist_ok=True)
    return path


def own_dir(case_name: str) -> str:
    """A directory this process alone writes (logs)."""
    path = os.path.join(shared_dir(case_name), f"process-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path



def run_case(name: str, strategy, plain: bool = True) -> tuple[dict, dict | None]:
    """Runs case `name` through keras_dist on `strategy`, then as plain Keras.

    Both start from the keras_dist model's initial weights (under
    multi-worker training: the chief's, broadcast to every worker).
    Returns (keras_dist results, plain Keras results), weights included;
    None for the plain results with `plain=False`.
    """
    make, _ = CASES[name]
    build, train = make()
    _mode["name"] = "keras_dist"
    model = build(strategy)
    if not isinstance(model, keras_dist.DistributedModel):
        model = keras_dist.distribute(model, strategy)
    initial = model.get_weights()
    distributed = train(model)
    distributed["weights"] = model.get_weights()
    distributed["initial"] = initial
    distributed["optimizer"] = type(getattr(model, "optimizer", None)).__name__
    if not plain:
        return distributed, None

    _mode["name"] = "plain"
    reference = build(None)
    reference.set_weights(initial)
    plain = train(reference)
    plain["weights"] = reference.get_weights()
    plain["initial"] = initial
    plain["optimizer"] = type(getattr(reference, "optimizer", None)).__name__
    return distributed, plain


def flat(results: dict) -> dict:
    """{name: array} with list values (weights) spread as name/i."""
    out = {}
    for key, value in results.items():
        if isinstance(value, list):
            for i, v in enumerate(value):
                out[f"{key}/{i}"] = np.asarray(v)
        else:
            out[key] = np.asarray(value)
    return out


def compare(distributed: dict, plain: dict) -> list[str]:
    """Differences beyond TOL, as readable lines (empty when equal)."""
    a, b = flat(distributed), flat(plain)
    adam = str(b.get("optimizer", "")) in ADAM_FAMILY
    problems = []
    if a.keys() != b.keys():
        problems.append(f"different results: {sorted(a.keys() ^ b.keys())}")
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if x.dtype.kind in "US" or y.dtype.kind in "US":
            if not np.array_equal(x, y):
                problems.append(f"{key}: {x} != {y}")
            continue
        if x.shape != y.shape:
            problems.append(f"{key}: shape {x.shape} != {y.shape}")
            continue
        diff = float(np.max(np.abs(x.astype("float64") - y.astype("float64")))) if x.size else 0.0
        tolerance = TOL_ADAM_WEIGHTS if adam and key.startswith("weights/") else TOL
        if not diff <= tolerance * max(1.0, float(np.max(np.abs(y))) if y.size else 1.0):
            problems.append(f"{key}: max |difference| {diff:.3g}")
    return problems


def max_weight_difference(distributed: dict, plain: dict) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(distributed["weights"], plain["weights"])
    )
