"""Tier 1: LearningRateScaler and scale_learning_rate (1, 2, 4 replicas)."""

import json
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from helpers import two_replicas
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks import LearningRateScaler

RS = np.random.RandomState(0)
X = RS.randn(64, 3).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype("float32")
W0 = np.array([[0.1], [0.2], [-0.3]], "float32")


def strategies():
    return {
        1: keras_dist.resolve_strategy("default"),
        2: two_replicas(),
        4: keras_dist.resolve_strategy("mirrored"),
    }


def linear(strategy, optimizer, metrics=None):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1)(inputs), strategy=strategy
    )
    model.set_weights([W0, np.zeros(1, "float32")])
    model.compile(optimizer, "mse", metrics=metrics)
    return model


class Rates(keras.callbacks.Callback):
    """Records the rate in effect for each next step (batch logs)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(logs["learning_rate"])


def current_rate(model):
    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def ramp(step, final, warmup):
    if warmup == 0:
        return final
    return 1.0 + (final - 1.0) * min(step / warmup, 1.0)


def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("rule", ["linear", "sqrt"])
@pytest.mark.parametrize("kind", ["float", "schedule"])
def test_warmup_ramp_and_final_rate_are_exact(replicas, rule, kind):
    strategy = strategies()[replicas]
    rate = 0.1 if kind == "float" else schedule()
    model = linear(strategy, keras.optimizers.SGD(rate))
    rates = Rates()
    history = model.fit(
        X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
        callbacks=[LearningRateScaler(rule, warmup_steps=5, verbose=1), rates],
    )
    final = replicas if rule == "linear" else math.sqrt(replicas)
    base = (lambda t: 0.1) if kind == "float" else (lambda t: 0.1 * 0.5 ** (t / 10))
    # After step k the optimizer has taken k steps: the next rate is r(k).
    expected = [base(k) * ramp(k, final, 5) for k in range(1, 17)]
    np.testing.assert_allclose(rates.rates, expected, rtol=1e-6)
    np.testing.assert_allclose(
        history.history["learning_rate"], [expected[7], expected[15]], rtol=1e-6
    )
    # Between fits the optimizer is the one the user built.
    if kind == "float":
        assert current_rate(model) == pytest.approx(0.1)
    else:
        assert model.optimizer._learning_rate.__class__ is keras.optimizers.schedules.ExponentialDecay


def numpy_sgd(batches, lr, momentum, factor, warmup, correction):
    """Keras' SGD update rule on a linear model with MSE, in float64."""
    w, b = W0.astype("float64"), np.zeros(1)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    for t, (xb, yb) in enumerate(batches):
        err = xb @ w + b - yb
        gw, gb = 2 * xb.T @ err / len(xb), 2 * err.sum(0) / len(xb)
        rate = lr * ramp(t, factor, warmup)
        mom = momentum
        if correction and t > 0:
            mom = momentum * ramp(t, factor, warmup) / ramp(t - 1, factor, warmup)
        vw, vb = mom * vw - rate * gw, mom * vb - rate * gb
        w, b = w + vw, b + vb
    return w, b


@pytest.mark.parametrize(
    "replicas,base_batch,correction",
    [(1, 4, True), (2, None, True), (4, None, False), (4, 8, True)],
)
def test_training_follows_the_scaled_momentum_sgd(replicas, base_batch, correction):
    model = linear(strategies()[replicas], keras.optimizers.SGD(0.02, momentum=0.9))
    model.fit(
        X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0,
        callbacks=[LearningRateScaler(
            base_batch_size=base_batch, warmup_steps=3,
            momentum_correction=correction,
        )],
    )
    factor = replicas if base_batch is None else 16 / base_batch
    batches = [(X[i:i + 16], Y[i:i + 16]) for i in range(0, 64, 16)]
    w, b = numpy_sgd(batches, 0.02, 0.9, factor, 3, correction)
    got_w, got_b = model.get_weights()
    np.testing.assert_allclose(got_w, w, atol=1e-5)
    np.testing.assert_allclose(got_b, b, atol=1e-5)
    assert model.optimizer.get_config()["momentum"] == 0.9


def test_warmup_epochs_is_converted_with_steps_per_epoch():
    model = linear(strategies()[2], keras.optimizers.SGD(0.1))
    scaler = LearningRateScaler(warmup_epochs=0.5)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[scaler])
    assert scaler.warmup_total_steps == 4  # half of 8 steps
    assert scaler.factor == 2


def test_base_batch_size_reads_a_dataset_batch():
    model = linear(strategies()[4], keras.optimizers.SGD(0.1))
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    history = model.fit(ds, epochs=1, verbose=0,
                        callbacks=[LearningRateScaler(base_batch_size=4)])
    assert history.history["learning_rate"][0] == pytest.approx(0.4)


def test_reduce_lr_on_plateau_reduces_the_scaled_rate_and_the_ramp_goes_on():
    model = linear(strategies()[4], keras.optimizers.SGD(0.01))
    rates = Rates()
    plateau = keras.callbacks.ReduceLROnPlateau(
        "loss", factor=0.5, patience=0, min_delta=1e9, verbose=0
    )
    model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[LearningRateScaler(warmup_steps=20, verbose=1), plateau, rates])
    # Keras counts the first epoch as an improvement: the plateau halves the
    # rate in effect after epoch 2 (step 16); the ramp continues from there.
    np.testing.assert_allclose(
        rates.rates[:16], [0.01 * ramp(k, 4, 20) for k in range(1, 17)], rtol=1e-6
    )
    np.testing.assert_allclose(
        rates.rates[16:], [0.005 * ramp(k, 4, 20) for k in range(17, 25)], rtol=1e-5
    )


def test_learning_rate_scheduler_values_are_used_as_given():
    model = linear(strategies()[2], keras.optimizers.SGD(0.01))
    scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.003)
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
                        callbacks=[LearningRateScaler(), scheduler])
    assert history.history["learning_rate"] == [pytest.approx(0.003)]


def test_second_fit_does_not_scale_twice_and_plain_fit_is_unscaled():
    model = linear(strategies()[4], keras.optimizers.SGD(0.01))
    for _ in range(2):
        history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
                            callbacks=[LearningRateScaler(warmup_steps=4)])
        assert history.history["learning_rate"] == [pytest.approx(0.04)]
        assert current_rate(model) == pytest.approx(0.01)
    before = model.get_weights()
    model.fit(X[:8], Y[:8], batch_size=8, epochs=1, verbose=0, shuffle=False)
    err = X[:8] @ before[0] + before[1] - Y[:8]
    np.testing.assert_allclose(
        model.get_weights()[0], before[0] - 0.01 * 2 * X[:8].T @ err / 8, atol=1e-6
    )


class Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() >= 6:
            raise RuntimeError("simulated crash")


def test_rate_continues_exactly_after_a_resume(tmp_path):
    def run(callbacks):
        model = linear(strategies()[4], keras.optimizers.SGD(0.01, momentum=0.9))
        rates = Rates()
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
            LearningRateScaler(warmup_steps=10, momentum_correction=True, verbose=1),
            *callbacks, rates,
        ])
        return model, rates.rates

    reference, expected = run([])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([BackupAndRestore(backup, save_freq=4), Crash()])
    model, rates = run([BackupAndRestore(backup, save_freq=4)])
    # Resumed after step 4: the remaining 12 steps, at the same rates.
    np.testing.assert_allclose(rates, expected[4:], rtol=1e-6)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-7)


def test_plain_keras_model_scales_by_its_strategy():
    with two_replicas().scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(X, Y, batch_size=8, verbose=0, callbacks=[LearningRateScaler()])
    assert history.history["learning_rate"] == [pytest.approx(0.02)]
    with pytest.raises(ValueError, match="base_batch_size=4"):
        model.fit(X, Y, batch_size=8, verbose=0,
                  callbacks=[LearningRateScaler(base_batch_size=4)])


def test_model_saved_during_fit_keeps_the_unscaled_rate(tmp_path):
    path = str(tmp_path / "m.keras")
    model = linear(strategies()[2], keras.optimizers.SGD(0.01, momentum=0.9))
    model.fit(X, Y, batch_size=8, verbose=0, callbacks=[
        LearningRateScaler(momentum_correction=True),
        keras.callbacks.ModelCheckpoint(path),
    ])
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.get_config()["learning_rate"] == pytest.approx(0.01)
    assert loaded.optimizer.get_config()["momentum"] == 0.9


def test_scale_learning_rate_arithmetic():
    assert keras_dist.scale_learning_rate(0.1, two_replicas()) == pytest.approx(0.2)
    assert keras_dist.scale_learning_rate(0.1, 16, rule="sqrt") == pytest.approx(0.4)
    assert keras_dist.scale_learning_rate(0.1, 16, rule="none") == 0.1


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: keras_dist.scale_learning_rate(1, 2), TypeError, "learning_rate=1 "),
        (lambda: keras_dist.scale_learning_rate(0.1, 0), ValueError, "scale=0"),
        (lambda: keras_dist.scale_learning_rate(0.1, "x"), TypeError, "scale='x'"),
        (lambda: keras_dist.scale_learning_rate(0.1, 2, "cube"), ValueError, "rule='cube'"),
        (lambda: LearningRateScaler("cube"), ValueError, "rule='cube'"),
        (lambda: LearningRateScaler(warmup_epochs=-1), ValueError, "warmup_epochs=-1"),
        (lambda: LearningRateScaler(warmup_steps=-2), ValueError, "warmup_steps=-2"),
        (lambda: LearningRateScaler(warmup_steps=1.5), ValueError, "warmup_steps=1.5"),
        (lambda: LearningRateScaler(base_batch_size=0), ValueError, "base_batch_size=0"),
        (lambda: LearningRateScaler(warmup_steps=2, warmup_epochs=1), ValueError,
         "mutually exclusive"),
        (lambda: LearningRateScaler(momentum_correction=1), TypeError,
         "momentum_correction=1"),
        (lambda: LearningRateScaler(verbose=2), ValueError, "verbose=2"),
    ],
)
def test_bad_arguments_are_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_warmup_epochs_with_unknown_length_is_rejected_before_training():
    model = linear(strategies()[1], keras.optimizers.SGD(0.1))

    def gen():
        while True:
            yield X[:8], Y[:8]

    ds = tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec((8, 3)), tf.TensorSpec((8, 1)))
    )
    with pytest.raises(ValueError, match="warmup_steps= instead"):
        model.fit(ds, epochs=1, verbose=0, steps_per_epoch=None,
                  callbacks=[LearningRateScaler(warmup_epochs=1)])
    assert model.optimizer.iterations.numpy() == 0


def test_a_resumed_run_with_another_factor_is_reported(tmp_path):
    """get_state/set_state: the factor is saved with a backup; a resume that
    scales differently (another replica count) says so."""
    class CrashAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() >= 3:
                raise RuntimeError("simulated crash")

    backup_dir = str(tmp_path / "b")
    model = linear(strategies()[4], keras.optimizers.SGD(0.1))
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=2), LearningRateScaler(), CrashAt()])
    with open(os.path.join(backup_dir, "latest")) as f:
        latest = f.read().strip()
    with open(os.path.join(backup_dir, latest, "state.json")) as f:
        states = json.load(f)["callbacks"]
    assert [s for k, s in states.items() if "LearningRateScaler" in k] == [
        {"factor": 4.0, "warmup_steps": 0}
    ]
    model = linear(strategies()[2], keras.optimizers.SGD(0.1))
    with pytest.warns(UserWarning, match="scaled the learning rate by 4, this run by 2"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=2), LearningRateScaler()])
