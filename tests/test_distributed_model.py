"""In-process tests of DistributedModel on 2 and 4 logical CPUs."""

import json
import os
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from helpers import max_abs_diff, mlp, optimizer, regression_data, two_replicas
from parity_cases import Batches, CustomFit

TOL = 1e-5


def strategies():
    return {"2": two_replicas(), "4": keras_dist.resolve_strategy("mirrored")}


def train(model_fn, strategy, opt, spe=1, epochs=2, batch_size=16, **fit_kwargs):
    x, y = regression_data()
    base = model_fn()
    model = keras_dist.distribute(base, strategy=strategy)
    model.compile(optimizer(opt), "mse", steps_per_execution=spe)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
        **fit_kwargs,
    )
    return model, history


_reference = {}


def reference(opt, batch_norm, spe=1):
    key = (opt, batch_norm, spe)
    if key not in _reference:
        model, history = train(lambda: mlp(batch_norm), "default", opt, spe)
        _reference[key] = (model.get_weights(), history.history["loss"])
    return _reference[key]


# A covering design: for 2 and for 4 replicas, every optimizer, BN setting
# and steps_per_execution appears, and every pair of them appears somewhere.
# 72 samples, global batch 16: four full batches and a partial one of 8.
COMBINATIONS = [
    ("sgd", False, 1),
    ("sgd", True, 4),
    ("adam", False, 4),
    ("adam", True, 1),
]


@pytest.mark.parametrize("replicas", ["2", "4"])
@pytest.mark.parametrize("opt, batch_norm, spe", COMBINATIONS)
def test_replicas_match_one_device(replicas, opt, batch_norm, spe):
    model, history = train(lambda: mlp(batch_norm), strategies()[replicas], opt, spe)
    ref_weights, ref_loss = reference(opt, batch_norm)
    assert model.distribute_strategy.num_replicas_in_sync == int(replicas)
    assert max_abs_diff(model.get_weights(), ref_weights) < TOL
    np.testing.assert_allclose(history.history["loss"], ref_loss, rtol=1e-5)


def test_uneven_last_batch_matches_one_device():
    # 72 samples, batch 20: last batch of 12 split over 4 replicas as 3 x 4
    # is even; batch 28 leaves 16 -> even too; use 70 samples, batch 16:
    # last batch of 6 splits 2/2/1/1.
    x, y = regression_data(n=70)

    def run(strategy):
        model = keras_dist.distribute(mlp(True), strategy=strategy)
        model.compile(optimizer("adam"), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    assert max_abs_diff(run("mirrored"), run("default")) < TOL


def test_even_then_uneven_runs_rebuild_the_step():
    # An even run (72 samples, batch 16: batches of 16 and 8) skips the split
    # correction and leaves a shape-generic step behind; the next fit (70
    # samples: last batch 2/2/1/1), a train_on_batch of 6 and a fit on a
    # dataset of unknown batch size each need the correction again.
    x, y = regression_data(n=72)
    dataset = tf.data.Dataset.from_tensor_slices((x[:70], y[:70])).batch(16)

    def run(strategy):
        model = keras_dist.distribute(mlp(True), strategy=strategy)
        model.compile(optimizer("sgd"), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model.fit(x[:70], y[:70], batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.train_on_batch(x[:6], y[:6])
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.fit(dataset, epochs=1, verbose=0)
        return model.get_weights()

    assert max_abs_diff(run("mirrored"), run("default")) < TOL


@pytest.mark.parametrize("replicas, batch, samples, even", [
    (1, 10, 73, True), (4, 16, 64, True), (4, 16, 72, True), (4, 16, 70, False),
    (4, 10, 40, False), (4, 16, None, True), (4, None, None, False),
])
def test_batches_split_evenly(replicas, batch, samples, even):
    from keras_dist import _data

    assert _data.batches_split_evenly(replicas, batch, samples) is even


def test_steps_per_execution_matches_single_steps():
    # 5 batches an epoch = 3 + 2: the last execution stops early.
    a, _ = train(lambda: mlp(True), "mirrored", "adam", spe=1)
    c, _ = train(lambda: mlp(True), "mirrored", "adam", spe=3)
    assert max_abs_diff(a.get_weights(), c.get_weights()) < TOL


def test_batch_norm_statistics_are_global():
    x, _ = regression_data(n=16)
    y = np.zeros((16, 3), "float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.BatchNormalization(momentum=0.0)(inputs)
    outputs = keras.layers.Dense(3)(outputs)
    model = keras_dist.DistributedModel(inputs, outputs, strategy="mirrored")
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[1]
    assert bn.synchronized
    # momentum=0: the moving statistics are the last batch's statistics.
    for replica_value in model.distribute_strategy.experimental_local_results(
        bn.moving_mean.value
    ):
        np.testing.assert_allclose(replica_value, x.mean(0), atol=1e-5)
    for replica_value in model.distribute_strategy.experimental_local_results(
        bn.moving_variance.value
    ):
        np.testing.assert_allclose(replica_value, x.var(0), atol=1e-4)


@pytest.mark.parametrize("shape, axis", [((4,), -1), ((3, 3, 2), -1), ((2, 3, 3), 1)])
def test_batch_norm_statistics_are_numerically_stable(shape, axis):
    # A channel whose mean is 100 times its spread: Keras' synchronized
    # statistics (E[x^2] - E[x]^2 in float32) cancel (measured 2.6e-4,
    # 4.7e-4 and 3.6e-4 from one device for the three cases); the two-pass
    # global statistics stay within float noise of one device's (dividing
    # by a spread of 0.05 magnifies it 20x: 3.0e-6, 1.2e-5 and 5.4e-6 on a
    # 2 GHz EPYC, under 1e-5 for all three on another CPU).
    rs = np.random.RandomState(0)
    x = (5.0 + 0.05 * rs.randn(64, *shape)).astype("float32")
    y = rs.randn(64, 1).astype("float32")

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input(shape), keras.layers.BatchNormalization(axis=axis),
            keras.layers.Flatten(), keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    reference = build()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = keras_dist.distribute(build(), strategy=two_replicas())
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.layers[0].synchronized
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 4e-5


def test_batch_norm_opt_out():
    model = keras_dist.distribute(mlp(True), "mirrored", sync_batch_norm=False)
    model.compile("sgd", "mse")
    assert not any(
        getattr(layer, "synchronized", False) for layer in model.layers
    )


# -- the three ways to make a DistributedModel ------------------------------


@keras.saving.register_keras_serializable(package="tests")
class Regressor(keras_dist.DistributedModel):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="tests")
class CustomStep(Regressor):
    """A user-written train_step with its own loss, on every replica."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.reduce(tf.reduce_mean(tf.square(pred - y), axis=-1))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}

    def reduce(self, per_sample):
        return tf.nn.compute_average_loss(per_sample, global_batch_size=16)


@pytest.mark.parametrize("cls", [Regressor, CustomStep])
def test_subclassed_model_matches_one_device(cls):
    x, y = regression_data(n=64)
    weights = {}
    for spec in ("default", "mirrored"):
        keras.utils.set_random_seed(3)
        model = cls(strategy=spec)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights[spec] = model.get_weights()
        assert model.distribute_strategy.num_replicas_in_sync == (
            1 if spec == "default" else 4
        )
    assert max_abs_diff(weights["default"], weights["mirrored"]) < TOL


@keras.saving.register_keras_serializable(package="tests")
class AverageLossStep(CustomStep):
    """The same train_step, reducing with `keras_dist.average_loss`."""

    def reduce(self, per_sample):
        return keras_dist.average_loss(per_sample)


def test_a_custom_train_step_with_average_loss_is_exact_on_any_split():
    """The reduction docs/parity.md gives a custom step: batch 10 on 4
    replicas (3/3/2/2) and a last batch of 3 (1/1/1/0) = one device."""
    x, y = regression_data(n=73)
    weights = {}
    for spec in ("default", "mirrored"):
        keras.utils.set_random_seed(3)
        model = AverageLossStep(strategy=spec)
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
        weights[spec] = model.get_weights()
    assert max_abs_diff(weights["default"], weights["mirrored"]) < TOL


class OwnTracker(keras.Model):
    """The same loss logged through a `Mean` of the model's own, in both
    steps (the test step also overridden)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracked = keras.metrics.Mean(name="tracked")

    def step(self, data, training):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=training)
            loss = self.compute_loss(y=y, y_pred=y_pred, training=training)
        if training:
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.tracked.update_state(loss)
        return {"tracked": self.tracked.result()}

    @property
    def metrics(self):
        return [self.tracked]

    def train_step(self, data):
        return self.step(data, True)

    def test_step(self, data):
        return self.step(data, False)


class GuideNet(keras.Model):
    """Keras' guide's step on a subclass with its own layers and `call`. Not
    a subclass of `CustomFit`: Keras rewrites the bases of a `keras.Model`
    subclass used functionally (as CustomFit is here), and its subclasses
    would then need inputs and outputs."""

    train_step = CustomFit.train_step

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, "tanh")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.hidden(x))


class DistributedGuideNet(GuideNet, keras_dist.DistributedModel):
    """The same class on `keras_dist.DistributedModel` as its base."""


def custom_step_model(form, x, strategy):
    """The model of `form`, built, on one device (`strategy` None) or distributed."""
    if form == "subclass on DistributedModel":
        model = GuideNet() if strategy is None else DistributedGuideNet(strategy=strategy)
        model(x[:1])
        return model
    inputs = keras.Input((x.shape[1],))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, "tanh")(inputs))
    model = {"guide, functional": CustomFit, "own tracker": OwnTracker}[form](inputs, outputs)
    return model if strategy is None else keras_dist.distribute(model, strategy=strategy)


@pytest.mark.parametrize("form", ["guide, functional", "own tracker",
                                  "subclass on DistributedModel"])
@pytest.mark.parametrize("n, batch_size", [
    (80, 16),  # every batch splits evenly on 2 and on 4 replicas
    (73, 10),  # 5/5 and 3/3/2/2, then a last batch of 3: 2/1 and 1/1/1/0
])
def test_a_custom_step_trains_and_logs_as_one_device(form, n, batch_size):
    """A custom `train_step` (Keras' guide's) trains to one device's weights
    on any split (Keras weights each replica's mean equally) and logs one
    device's numbers (Keras logs 1/N of the loss `compute_loss` returned),
    every epoch, in evaluate too, on 2 and 4 replicas."""
    x, y = regression_data(n=n)
    weights = custom_step_model(form, x, None).get_weights()
    logged, trained = {}, {}
    for name, strategy in {"one device": None, **strategies()}.items():
        model = custom_step_model(form, x, strategy)
        model.set_weights(weights)
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x[:21], y[:21]))  # 16 + 5: uneven
        logged[name] = history.history
        trained[name] = model.get_weights()
    expected = logged.pop("one device")
    for name, history in logged.items():
        assert history.keys() == expected.keys(), name
        for key, values in expected.items():
            np.testing.assert_allclose(history[key], values, rtol=TOL, err_msg=f"{name}: {key}")
        assert max_abs_diff(trained[name], trained["one device"]) < TOL


def test_subclass_weights_live_on_the_strategy():
    model = Regressor(strategy="mirrored")
    model(np.zeros((4, 6), "float32"))  # built eagerly, outside any scope
    assert all(
        isinstance(v.value, tf.distribute.DistributedValues) for v in model.weights
    )


def test_functional_form_adopts_layers_built_outside_the_scope():
    inputs = keras.Input((6,))
    dense = keras.layers.Dense(1)
    outputs = dense(inputs)  # weights created here, outside any scope
    initial = dense.get_weights()
    model = keras_dist.DistributedModel(inputs, outputs, strategy="mirrored")
    assert all(
        isinstance(v.value, tf.distribute.DistributedValues) for v in model.weights
    )
    assert max_abs_diff(model.get_weights(), initial) == 0


@pytest.mark.parametrize("kind", ["sequential", "unbuilt_sequential", "functional",
                                  "subclassed"])
def test_distribute_keeps_weights(kind):
    x, _ = regression_data(n=8)
    keras.utils.set_random_seed(5)
    if kind == "sequential":
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    elif kind == "unbuilt_sequential":
        model = keras.Sequential([keras.layers.Dense(3)])
    elif kind == "functional":
        model = mlp()
    else:
        model = Plain()
    if kind != "unbuilt_sequential":
        model(x)
    dist = keras_dist.distribute(model, "mirrored")
    assert isinstance(dist, keras_dist.DistributedModel)
    if kind != "unbuilt_sequential":
        assert max_abs_diff(dist.get_weights(), model.get_weights()) == 0
        np.testing.assert_allclose(
            dist.predict(x, batch_size=8, verbose=0), model(x), atol=1e-6
        )
    else:
        assert dist.predict(x, batch_size=8, verbose=0).shape == (8, 3)
    assert all(
        isinstance(v.value, tf.distribute.DistributedValues) for v in dist.weights
    )


@keras.saving.register_keras_serializable(package="tests")
class Plain(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


def test_distribute_compiled_model_keeps_optimizer_state():
    x, y = regression_data()
    model = mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = [v.numpy() for v in model.optimizer.variables]
    dist = keras_dist.distribute(model, "mirrored")
    assert dist is model
    assert int(dist.optimizer.iterations.numpy()) == 9
    assert all(
        isinstance(v.value, tf.distribute.DistributedValues)
        for v in dist.optimizer.variables
    )
    assert max_abs_diff([v.numpy() for v in dist.optimizer.variables], before) == 0
    dist.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(dist.optimizer.iterations.numpy()) == 18


def test_distribute_rejects_non_models():
    with pytest.raises(TypeError, match="argument `model`"):
        keras_dist.distribute(keras.layers.Dense(2))


# -- inputs ----------------------------------------------------------------


def test_tf_data_and_dict_inputs_match_one_device():
    x, y = regression_data(n=64)
    weights = {}
    for spec in ("default", "mirrored"):
        keras.utils.set_random_seed(2)
        a = keras.Input((3,), name="a")
        b = keras.Input((3,), name="b")
        out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
        model = keras_dist.DistributedModel([a, b], out, strategy=spec)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        ds = tf.data.Dataset.from_tensor_slices(
            ({"a": x[:, :3], "b": x[:, 3:]}, y)
        ).batch(16)
        model.fit(ds, epochs=2, verbose=0)
        model.fit({"a": x[:, :3], "b": x[:, 3:]}, y, batch_size=16, shuffle=False,
                  verbose=0)
        weights[spec] = model.get_weights()
    assert max_abs_diff(weights["default"], weights["mirrored"]) < TOL


def test_evaluate_and_predict_match_one_device():
    x, y = regression_data(n=70)
    base = mlp(True)
    one = keras_dist.distribute(base, "default")
    many = keras_dist.distribute(base, "mirrored")
    for m in (one, many):
        m.compile("sgd", "mse", metrics=[keras.metrics.MeanAbsoluteError()])
    np.testing.assert_allclose(
        many.evaluate(x, y, batch_size=16, verbose=0),
        one.evaluate(x, y, batch_size=16, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        many.predict(x, batch_size=16, verbose=0),
        one.predict(x, batch_size=16, verbose=0),
        atol=1e-6,
    )


def test_per_replica_batch_size():
    a, _ = train(lambda: mlp(), "mirrored", "sgd", batch_size=16)
    x, y = regression_data()
    b = keras_dist.distribute(mlp(), "mirrored")
    b.compile(optimizer("sgd"), "mse")
    history = b.fit(x, y, epochs=2, shuffle=False, verbose=0, per_replica_batch_size=4)
    assert max_abs_diff(a.get_weights(), b.get_weights()) < TOL
    assert len(history.history["loss"]) == 2
    assert b.predict(x, per_replica_batch_size=4, verbose=0).shape == (72, 1)


def test_validation_data_and_split():
    x, y = regression_data()
    model = keras_dist.distribute(mlp(), "mirrored")
    model.compile("sgd", "mse")
    h = model.fit(x, y, batch_size=16, validation_split=0.25, epochs=1, verbose=0)
    assert "val_loss" in h.history
    h = model.fit(x, y, batch_size=16, validation_data=(x, y), epochs=1, verbose=0)
    assert np.isfinite(h.history["val_loss"][0])


# -- bad input --------------------------------------------------------------


def compiled(spec="mirrored"):
    model = keras_dist.distribute(mlp(), spec)
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(batch_size=16, per_replica_batch_size=4), ValueError,
         r"mutually exclusive.*batch_size=16, per_replica_batch_size=4"),
        (dict(batch_size=0), ValueError, r"`batch_size`.*Received: batch_size=0"),
        (dict(batch_size=-8), ValueError, r"Received: batch_size=-8"),
        (dict(batch_size=16.0), TypeError, r"Received: batch_size=16.0"),
        (dict(per_replica_batch_size=0), ValueError, r"per_replica_batch_size=0"),
    ],
)
def test_bad_batch_sizes_fail_before_training(kwargs, error, pattern):
    model = compiled()
    before = model.get_weights()
    x, y = regression_data()
    with pytest.raises(error, match=pattern):
        model.fit(x, y, verbose=0, **kwargs)
    assert model.optimizer.iterations.numpy() == 0
    assert max_abs_diff(model.get_weights(), before) == 0


def _rows(n, width=8):
    return np.random.default_rng(0).normal(size=(n, width)).astype("float32")


@pytest.mark.parametrize(
    "arrays, kwargs, error, pattern",
    [
        ((60, 64, None), {}, ValueError, r"cardinality.*x: 60, y: 64"),
        ((64, 60, None), {}, ValueError, r"cardinality.*x: 64, y: 60"),
        ((64, 64, 10), {}, ValueError, r"cardinality.*sample_weight: 10"),
        ((0, 0, None), {}, ValueError, r"no samples.*x: 0, y: 0"),
        ((64, 64, None), dict(validation_split=-0.5), ValueError,
         r"`validation_split`.*\[0, 1\).*validation_split=-0.5"),
        ((64, 64, None), dict(validation_split=1.0), ValueError,
         r"validation_split=1.0"),
        ((64, 64, None), dict(epochs=1.5), TypeError, r"`epochs`.*epochs=1.5"),
        ((64, 64, None), dict(epochs=-1), ValueError, r"epochs=-1"),
        ((64, 64, None), dict(initial_epoch="1"), TypeError, r"initial_epoch='1'"),
        ((64, 64, None), dict(validation_data=(_rows(8), np.zeros((9, 1)))),
         ValueError, r"validation_data's x: 8, validation_data's y: 9"),
    ],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_bad_input_fails_before_training(arrays, kwargs, error, pattern, shuffle):
    """What plain Keras refuses up front, keras_dist refuses up front too."""
    model = compiled()
    before = model.get_weights()
    nx, ny, nw = arrays
    x, y = _rows(nx), np.zeros((ny, 1), "float32")
    weights = None if nw is None else np.ones(nw, "float32")
    with pytest.raises(error, match=pattern):
        model.fit(x, y, sample_weight=weights, batch_size=16, shuffle=shuffle,
                  verbose=0, **kwargs)
    assert model.optimizer.iterations.numpy() == 0
    assert max_abs_diff(model.get_weights(), before) == 0


def test_string_arrays_are_refused_and_string_tensors_train():
    model = compiled()
    with pytest.raises(ValueError, match=r"`x`.*dtype <U1.*StringLookup"):
        model.fit(np.array([["a"] * 8] * 16), np.zeros((16, 1)), verbose=0)
    with pytest.raises(ValueError, match=r"`y`.*dtype <U3"):
        model.evaluate(_rows(16), np.array(["cat"] * 16), verbose=0)
    with pytest.raises(ValueError, match="cardinality.*x: 16, y: 8"):
        model.evaluate(_rows(16), np.zeros((8, 1)), verbose=0)
    with pytest.raises(ValueError, match=r"`x\[1\]`.*dtype object"):
        model.predict([_rows(16), np.array([None] * 16)], verbose=0)
    # Text as a tf.Tensor reaches a model that starts with a text layer.
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
    inputs = keras.Input((1,), dtype="string")
    outputs = keras.layers.Dense(1)(keras.ops.cast(lookup(inputs), "float32"))
    text = keras_dist.distribute(keras.Model(inputs, outputs), "mirrored")
    text.compile("sgd", "mse")
    history = text.fit(tf.constant([["a"], ["b"]] * 8), np.zeros((16, 1)),
                       batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.parametrize("loss", [
    "sparse_categorical_crossentropy",
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    keras.losses.sparse_categorical_crossentropy,
])
def test_out_of_range_class_labels_fail_before_training(loss):
    inputs = keras.Input((8,))
    model = keras_dist.distribute(
        keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs)),
        "mirrored",
    )
    model.compile("sgd", loss)
    x = _rows(32)
    with pytest.raises(ValueError, match=r"`y`.*\[0, 3\).*label 5"):
        model.fit(x, np.full(32, 5), batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data's y`.*label -1"):
        model.fit(x, np.zeros(32, "int64"), validation_data=(x, np.full(32, -1)),
                  verbose=0)
    with pytest.raises(ValueError, match=r"label 3"):
        model.evaluate(x, np.arange(32) % 4, verbose=0)
    assert model.optimizer.iterations.numpy() == 0
    # Labels in range, and an ignored class, train.
    model.fit(x, np.arange(32) % 3, batch_size=16, verbose=0)
    ignoring = keras_dist.distribute(
        keras.Model(inputs, keras.layers.Dense(3)(inputs)), "mirrored"
    )
    ignoring.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1))
    ignoring.fit(x, np.where(np.arange(32) % 4 == 3, -1, np.arange(32) % 3),
                 batch_size=16, verbose=0)


def test_out_of_range_class_labels_in_a_dataset_stop_the_step_naming_the_fix():
    # A tf.data pipeline cannot be scanned up front: the step checks each
    # batch and stops before the bad batch's update, naming the fix.
    inputs = keras.Input((8,))
    model = keras_dist.distribute(
        keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs)),
        "mirrored",
    )
    model.compile("sgd", "sparse_categorical_crossentropy")
    x = _rows(32)
    before = model.get_weights()
    labels = np.where(np.arange(32) < 16, 5, 1)  # the first batch is bad
    bad = tf.data.Dataset.from_tensor_slices((x, labels)).batch(16)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`y`.*\[0, 3\).*Map the labels to 0..classes-1"):
        model.fit(bad, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`y`.*\[0, 3\)"):
        model.evaluate(tf.data.Dataset.from_tensor_slices((x, -labels)).batch(16),
                       verbose=0)
    # A good pipeline trains (the check adds no collective and no retrace).
    good = tf.data.Dataset.from_tensor_slices((x, np.arange(32) % 3)).batch(16)
    history = model.fit(good, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_gradient_accumulation_on_replicas_is_one_device_with_the_larger_batch():
    # k=2 accumulated steps of global batch 16 on 4 replicas = plain Keras on
    # one device with batch 32 and no accumulation (SGD momentum, no batch
    # statistics involved).
    x, y = regression_data(n=64)
    reference = mlp()
    model = keras_dist.distribute(mlp(), "mirrored")
    reference.set_weights(model.get_weights())
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2), "mse")
    reference.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    assert model.distribute_strategy.num_replicas_in_sync == 4
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-5


def test_validation_batch_size_need_not_split_over_the_replicas():
    model = compiled()
    x, y = regression_data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(ValueError, match="validation_batch_size=0"):
        model.fit(ds, validation_data=(x, y), validation_batch_size=0, verbose=0)
    assert model.optimizer.iterations.numpy() == 0
    # 6 on 4 replicas: each batch split 2/2/1/1, the validation loss exact.
    history = model.fit(ds, validation_data=(x, y), validation_batch_size=6, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1],
                               model.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)


def test_evaluate_and_predict_take_any_batch_size():
    model = compiled()
    x, y = regression_data()
    # 6 and 7 on 4 replicas: split as a last partial batch is; exact.
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=6, verbose=0),
                               model.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=7, verbose=0),
                               model.predict(x, batch_size=8, verbose=0), atol=1e-6)
    with pytest.raises(ValueError, match="mutually exclusive"):
        model.predict(x, batch_size=8, per_replica_batch_size=2, verbose=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        model.evaluate(x, y, batch_size=0, verbose=0)


@pytest.mark.parametrize("form", ["arrays", "dataset", "keras_default"])
def test_a_batch_the_replicas_do_not_divide_trains_as_one_device(form):
    """A global batch of 10 on 4 replicas (3/3/2/2 every step; a dataset of
    fixed batch 10; Keras' default of 32 on 3 replicas): plain Keras runs it,
    and so does keras_dist, with one device's update, BatchNormalization
    and Dropout included (its masks: each replica its rows)."""
    x, y = regression_data(n=75)
    replicas = 3 if form == "keras_default" else 4

    def build():
        inputs = keras.Input((x.shape[1],))
        h = keras.layers.Dense(8)(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.Dropout(0.25, seed=5)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    plain = build()
    # 3 replicas: reduced on one device (TF numbers the collective groups of
    # every MirroredStrategy from 1: this process's 2-replica one has group 1).
    strategy = (tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1", "/cpu:2"], cross_device_ops=tf.distribute.ReductionToOneDevice())
        if replicas == 3 else strategies()["4"])
    model = keras_dist.distribute(keras.models.clone_model(plain), strategy)
    model.set_weights(plain.get_weights())
    runs = []
    for m in (plain, model):
        m.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
        if form == "dataset":
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10, drop_remainder=True)
            history = m.fit(ds, epochs=2, validation_data=ds, verbose=0)
        else:
            batch = {"batch_size": 10} if form == "arrays" else {}
            history = m.fit(x, y, epochs=2, shuffle=False, validation_split=0.2, verbose=0,
                            **batch)
        runs.append(history.history)
    assert model.distribute_strategy.num_replicas_in_sync == replicas
    assert max_abs_diff(model.get_weights(), plain.get_weights()) < TOL
    assert runs[1].keys() == runs[0].keys()
    for name in runs[0]:
        np.testing.assert_allclose(runs[1][name], runs[0][name], rtol=1e-5, err_msg=name)


def test_per_replica_batch_size_is_refused_with_a_dataset():
    model = compiled()
    x, y = regression_data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(ValueError, match="per_replica_batch_size"):
        model.fit(ds, per_replica_batch_size=2, verbose=0)


def test_bad_sync_batch_norm():
    with pytest.raises(TypeError, match="sync_batch_norm"):
        keras_dist.DistributedModel(strategy="default", sync_batch_norm="yes")


# -- compile ----------------------------------------------------------------


def test_optimizer_and_metrics_created_outside_the_scope():
    opt = keras.optimizers.Adam(0.01)
    mae = keras.metrics.MeanAbsoluteError()
    model = keras_dist.distribute(mlp(), "mirrored")
    model.compile(opt, "mse", metrics=[mae])
    x, y = regression_data()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert "mean_absolute_error" in history.history


def test_two_fits_in_a_row_continue_training():
    x, y = regression_data()
    once, _ = train(lambda: mlp(), "mirrored", "adam", epochs=2)
    twice = keras_dist.distribute(mlp(), "mirrored")
    twice.compile(optimizer("adam"), "mse")
    twice.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    twice.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_abs_diff(once.get_weights(), twice.get_weights()) < TOL


# -- saving -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["functional", "subclassed", "wrapped"])
def test_save_and_load_round_trip(tmp_path, kind):
    x, y = regression_data()
    if kind == "functional":
        model = keras_dist.distribute(mlp(True), "mirrored")
    elif kind == "subclassed":
        model = Regressor(units=5, strategy="mirrored")
    else:
        model = keras_dist.distribute(Plain(), "mirrored")
    model.compile("adam", "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    expected = model.predict(x, batch_size=16, verbose=0)
    # Loaded under another strategy: the one in scope.
    with two_replicas().scope():
        loaded = keras.models.load_model(path)
    if kind == "wrapped":
        # distribute() keeps the user's class: the file loads as that class,
        # as with plain Keras, and is distributed again in one call.
        assert type(loaded) is Plain
        loaded = keras_dist.distribute(loaded, two_replicas())
    assert isinstance(loaded, keras_dist.DistributedModel)
    assert loaded.distribute_strategy is two_replicas()
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               expected, atol=1e-6)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # And with no scope: "auto" (4 replicas here).
    plain = keras.models.load_model(path)
    if kind == "wrapped":
        plain = keras_dist.distribute(plain)
    assert plain.distribute_strategy.num_replicas_in_sync == 4


def test_files_of_the_first_wrapper_format_still_load(tmp_path):
    """keras_dist 0.1's `distribute()` saved a `DistributedWrapper` holding
    the model (registered as keras_dist>DistributedWrapper); such files load,
    predict as saved and train."""
    from keras_dist.distributed_model import DistributedWrapper

    x, y = regression_data()
    with two_replicas().scope():
        old = DistributedWrapper(mlp(True), strategy=two_replicas())
    old.compile("adam", "mse")
    old.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "old.keras")
    old.save(path)
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    assert config["registered_name"] == "keras_dist>DistributedWrapper"
    loaded = keras.models.load_model(path)
    assert type(loaded) is DistributedWrapper
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               old.predict(x, batch_size=16, verbose=0), atol=1e-6)
    loaded.compile("adam", "mse")
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_save_weights_round_trip(tmp_path):
    model, _ = train(lambda: mlp(), "mirrored", "sgd")
    path = os.path.join(tmp_path, "w.weights.h5")
    model.save_weights(path)
    other = keras_dist.distribute(mlp(seed=9), "mirrored")
    other.load_weights(path)
    assert max_abs_diff(model.get_weights(), other.get_weights()) == 0


# -- mixed precision -------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("spec", ["default", "mirrored"])
def test_mixed_precision(policy, spec):
    x, y = regression_data()
    keras.config.set_dtype_policy(policy)
    try:
        model = keras_dist.distribute(mlp(True), spec)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    assert model.layers[1].compute_dtype == policy.split("_")[1]
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert history.history["loss"][-1] < history.history["loss"][0]


# -- Python-made batches -------------------------------------------------------


def aligned(array: np.ndarray) -> np.ndarray:
    """A copy on 64-byte aligned memory (TensorFlow then shares it, not copies)."""
    buffer = np.empty(array.nbytes + 64, np.uint8)
    offset = (-buffer.ctypes.data) % 64
    out = buffer[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


@pytest.mark.parametrize("kind", ["py_dataset", "generator", "arrays"])
def test_python_batches_are_never_written_into(kind):
    """TF 2.21 on several replicas wrote into NumPy batches (views of y)."""
    x, y = (aligned(a) for a in regression_data(n=64))
    x0, y0 = x.copy(), y.copy()
    model = keras_dist.distribute(mlp(), two_replicas())
    model.compile("sgd", "mse")
    for _ in range(3):
        if kind == "py_dataset":
            data = Batches(x, y, 16)
            model.fit(data, epochs=2, verbose=0)
        elif kind == "generator":
            data = ((x[i:i + 16], y[i:i + 16]) for _ in range(2) for i in range(0, 64, 16))
            model.fit(data, steps_per_epoch=4, epochs=2, verbose=0)
        else:
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        model.evaluate(Batches(x, y, 16), verbose=0)
        model.predict(Batches(x, y, 16), verbose=0)
    assert np.array_equal(x, x0) and np.array_equal(y, y0)


# -- objects Keras users make, with no config round trip -----------------------


class MeanSquared(keras.metrics.Mean):
    """A custom metric whose constructor takes no config."""

    def __init__(self):
        super().__init__(name="mse")

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(tf.square(y_true - y_pred))


class CustomStepModel(keras_dist.DistributedModel):
    """Keras' "customizing fit()" pattern, deriving from DistributedModel."""

    steps = 0

    def train_step(self, data):
        CustomStepModel.steps += 1
        return super().train_step(data)


def test_user_objects_need_no_config():
    x, y = regression_data(n=32)
    metric = MeanSquared()
    # A subclass used functionally, on layers built first.
    inputs = keras.Input((6,))
    model = CustomStepModel(inputs, keras.layers.Dense(1)(inputs), strategy=two_replicas())
    model.compile(keras.optimizers.SGD(0.1), lambda t, p: tf.reduce_mean(tf.abs(t - p)),
                  metrics=[metric])
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert CustomStepModel.steps > 0 and "mse" in history.history
    # A compiled model whose compile config cannot be serialized (a lambda
    # loss), converted after compile; and an empty Sequential.
    compiled = mlp()
    compiled.compile("sgd", lambda t, p: tf.reduce_mean(tf.square(t - p)))
    compiled = keras_dist.distribute(compiled, two_replicas())
    compiled.fit(x, y, batch_size=8, verbose=0)
    empty = keras_dist.distribute(keras.Sequential(), two_replicas())
    empty.add(keras.layers.Dense(1))
    empty.compile("sgd", "mse")
    empty.fit(x, y, batch_size=8, verbose=0)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in empty.weights)
