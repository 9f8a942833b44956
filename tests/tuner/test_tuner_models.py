"""keras-tuner's four tuners with the models users write, each trial distributed.

Hypermodels as keras-tuner users write them: functional graphs with `Lambda`
and custom layers without `get_config`, subclassed models with
non-serializable constructor arguments, dict inputs and outputs. Every trial
completes on the strategy, and `get_best_models()` returns a working
`DistributedModel`.
"""

import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import tuner as kd_tuner
from parity_cases import Scale, Tower, data

X, Y = data()


def functional(hp):
    inputs = keras.Input((4,))
    h = keras.layers.Lambda(lambda t: t * 2.0)(inputs)
    h = Scale(hp.Choice("units", [4, 8]), tf.nn.relu)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(hp.Choice("lr", [0.01, 0.02])), "mse")
    return model


def subclassed(hp):
    model = Tower(keras.layers.Dense(1), activation=lambda t: tf.nn.tanh(t))
    model.compile(keras.optimizers.SGD(hp.Choice("lr", [0.01, 0.05])), "mse")
    return model


def dict_io(hp):
    a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(hp.Choice("units", [4, 8]))(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"out": keras.layers.Dense(1, name="out")(h)})
    model.compile(keras.optimizers.Adam(hp.Choice("lr", [0.01, 0.02])), {"out": "mse"})
    return model


TUNERS = {
    "random": lambda build, **kw: kd_tuner.RandomSearch(build, max_trials=2, **kw),
    "bayesian": lambda build, **kw: kd_tuner.BayesianOptimization(
        build, max_trials=2, num_initial_points=1, **kw),
    "hyperband": lambda build, **kw: kd_tuner.Hyperband(build, max_epochs=2, factor=2, **kw),
    "grid": lambda build, **kw: kd_tuner.GridSearch(build, max_trials=3, **kw),
}
MODELS = {"functional": functional, "subclassed": subclassed, "dict_io": dict_io}


# Each tuner once, each model kind at least once (the search is the slow part).
PAIRS = [("random", "subclassed"), ("bayesian", "dict_io"),
         ("hyperband", "subclassed"), ("grid", "functional")]


@pytest.mark.parametrize("tuner_kind,model_kind", PAIRS)
def test_tuner_trials_complete_and_best_model_works(tmp_path, tuner_kind, model_kind):
    strategy = keras_dist.resolve_strategy("mirrored")
    tuner = TUNERS[tuner_kind](
        MODELS[model_kind], objective="val_loss", directory=str(tmp_path),
        project_name="p", strategy=strategy,
    )
    xs, ys = X, Y
    if model_kind == "dict_io":
        xs, ys = {"a": X[:, :2], "b": X[:, 2:]}, {"out": Y}
    tuner.search(xs, ys, epochs=2, batch_size=16, validation_split=0.25, verbose=0)
    trials = tuner.oracle.trials.values()
    assert trials and all(
        t.status == keras_tuner.engine.trial.TrialStatus.COMPLETED for t in trials
    ), [t.status for t in trials]
    best = tuner.get_best_models(1)[0]
    assert isinstance(best, keras_dist.DistributedModel)
    assert best.distribute_strategy is strategy
    prediction = best.predict(xs, batch_size=16, verbose=0)
    if model_kind == "dict_io":
        assert sorted(prediction) == ["out"]
        prediction = prediction["out"]
    assert prediction.shape == (len(X), 1) and np.all(np.isfinite(prediction))
    # The best model holds its trial's trained weights (its val_loss).
    best_trial = tuner.oracle.get_best_trials(1)[0]
    split = int(len(X) * 0.75)
    val = {k: v[split:] for k, v in xs.items()} if isinstance(xs, dict) else xs[split:]
    yval = {k: v[split:] for k, v in ys.items()} if isinstance(ys, dict) else ys[split:]
    loss = best.evaluate(val, yval, batch_size=16, verbose=0)
    loss = loss[0] if isinstance(loss, list) else loss
    np.testing.assert_allclose(loss, best_trial.score, rtol=1e-4)
