"""Every model form users write, in one process, in more than one order.

Each form is built twice from the same (unseeded) initial weights: through
keras_dist on 2 replicas and as plain Keras on one device; both train with
`validation_split`, a metric and momentum SGD, and every logged number
(loss, val_loss, each metric, each epoch), `evaluate`, `predict` and the
weights must agree. The forms run in one process in several orders, each
order with freshly defined user classes, because a form that changes a
class other models share breaks the forms after it; the classes of keras_dist
and Keras must come out of all of it unchanged.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest

import keras_dist
from helpers import two_replicas
from parity_cases import compare, data, fit_eval_predict, mlp_layers

D = 4


def user_classes(base):
    """The subclass forms, defined anew on `base` (keras.Model or DistributedModel)."""

    class Net(base):
        """A subclass with its own `call`."""

        def __init__(self, units=8, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(units, activation="relu")
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    class Guide(base):
        """Keras' "customizing fit()" guide: the graph built in `__init__`."""

        def __init__(self, units=8, **kwargs):
            inputs = keras.Input((D,))
            h = keras.layers.Dense(units, activation="relu")(inputs)
            super().__init__(inputs=inputs, outputs=keras.layers.Dense(1)(h), **kwargs)

        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    class Functionally(base):
        """A subclass used as `Functionally(inputs, outputs)`."""

        def test_step(self, data):
            return super().test_step(data)

    return Net, Guide, Functionally


def _functional(base, classes=None, **kw):
    inputs = keras.Input((D,))
    outputs = mlp_layers(inputs)
    if base is keras.Model:
        return keras.Model(inputs, outputs)
    return keras_dist.DistributedModel(inputs, outputs, **kw)


def _sequential(base, classes=None, **kw):
    return keras.Sequential(
        [keras.Input((D,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


# name -> (uses keras_dist's own class, build(base, classes, **strategy kwargs))
FORMS = {
    "functional + distribute()": (False, lambda b, c, **kw: _functional(keras.Model)),
    "Sequential + distribute()": (False, _sequential),
    "subclass with call + distribute()": (False, lambda b, c, **kw: c[0]()),
    "subclass built in __init__ + distribute()": (False, lambda b, c, **kw: c[1]()),
    "DistributedModel(inputs, outputs)": (True, _functional),
    "DistributedModel subclass with call": (True, lambda b, c, **kw: c[0](**kw)),
    "DistributedModel subclass built in __init__": (True, lambda b, c, **kw: c[1](**kw)),
    "DistributedModel subclass used functionally": (
        True,
        lambda b, c, **kw: _used_functionally(c[2], **kw),
    ),
}


def _used_functionally(cls, **kw):
    inputs = keras.Input((D,))
    return cls(inputs, mlp_layers(inputs), **kw)


def train(model):
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
    x, y = data()
    return fit_eval_predict(model, x, y, validation_split=0.25, epochs=2)


def run_form(name: str, strategy) -> tuple[dict, dict]:
    own_class, build = FORMS[name]
    x = data()[0]
    kd_base = keras_dist.DistributedModel if own_class else keras.Model
    model = build(kd_base, user_classes(kd_base), strategy=strategy)
    if not model.built:
        model(x[:2])
    if not own_class:
        model = keras_dist.distribute(model, strategy)
    assert isinstance(model, keras_dist.DistributedModel)
    initial = model.get_weights()
    distributed = train(model)
    distributed["weights"] = model.get_weights()

    reference = build(keras.Model, user_classes(keras.Model))
    if not reference.built:
        reference(x[:2])
    reference.set_weights(initial)
    plain = train(reference)
    plain["weights"] = reference.get_weights()
    return distributed, plain


def class_state(classes) -> dict:
    """What building or fitting must not change: bases and attributes by identity."""
    return {
        # (`__annotations__` is created on first read: not a change.)
        cls: (
            cls.__bases__,
            {k: id(v) for k, v in vars(cls).items() if k != "__annotations__"},
        )
        for cls in classes
    }


def shared_classes() -> list[type]:
    """keras_dist's model and callback classes, and the Keras classes they reach."""
    from keras_dist import distributed_model

    ours = [
        obj
        for module in (distributed_model, keras_dist, keras_dist.callbacks)
        for obj in vars(module).values()
        if inspect.isclass(obj) and obj.__module__.startswith("keras_dist")
    ]
    theirs = {
        cls
        for root in (keras_dist.DistributedModel, keras.Sequential, keras_dist.distributed_model.Functional)
        for cls in inspect.getmro(root)
        if cls.__module__.startswith(("keras", "tensorflow"))
    }
    theirs |= {
        keras.layers.Dense, keras.layers.Layer, keras.optimizers.SGD,
        keras.optimizers.Optimizer, keras.metrics.MeanAbsoluteError,
        keras.callbacks.Callback, keras.callbacks.History, keras.callbacks.ProgbarLogger,
    }
    return sorted(set(ours) | theirs, key=lambda c: (c.__module__, c.__qualname__))


ORDERS = {
    "reversed": list(reversed(FORMS)),
    "built in __init__ first": sorted(FORMS, key=lambda n: "built in __init__" not in n),
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_every_form_in_one_process_matches_plain_keras(order):
    strategy = two_replicas()
    before = class_state(shared_classes())
    problems = []
    for name in ORDERS[order]:
        distributed, plain = run_form(name, strategy)
        problems += [f"{name}: {p}" for p in compare(distributed, plain)]
        # Logged numbers checked key by key, not only the weights.
        assert {k for k in distributed if k.startswith("history/")} == {
            "history/loss", "history/mae", "history/val_loss", "history/val_mae"
        }
    assert not problems, "\n".join(problems)
    after = class_state(shared_classes())
    changed = [
        f"{cls.__module__}.{cls.__qualname__}" for cls in before if before[cls] != after[cls]
    ]
    assert not changed, f"classes changed by building and fitting: {changed}"


def test_a_guide_subclass_leaves_distributed_model_as_it_was():
    Net, Guide, _ = user_classes(keras_dist.DistributedModel)
    bases = keras_dist.DistributedModel.__bases__
    guide = Guide(strategy=two_replicas())
    assert keras_dist.DistributedModel.__bases__ == bases == (keras.Model,)
    # As Keras does for its own subclasses: the user's class is functional now.
    assert isinstance(guide, keras_dist.distributed_model.Functional)
    assert type(guide) is Guide
    net = Net(strategy=two_replicas())
    net.compile("sgd", "mse")
    x, y = data()
    net.fit(x, y, batch_size=16, verbose=0)
    assert np.isfinite(net.evaluate(x, y, verbose=0))


def test_an_optimizer_attribute_that_is_not_an_optimizer():
    # keras-tuner's own test models set `self.optimizer = True`; Keras does not
    # forbid it, and neither does distribute().
    class Mock(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.optimizer = True

        def call(self, x):
            return self.dense(x)

    model = Mock()
    x = data()[0]
    before = model(x[:2]).numpy()
    model = keras_dist.distribute(model, two_replicas())
    assert model.optimizer is True
    np.testing.assert_array_equal(model(x[:2]).numpy(), before)


def test_a_warning_raised_while_traced_comes_once_as_on_one_device():
    import warnings

    class Warns(keras.layers.Layer):
        def call(self, x):
            warnings.warn("a layer's own warning")  # noqa: B028 (as a user writes it)
            return x

    def counts(model):
        model.compile("sgd", "mse")
        x, y = data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            model.evaluate(x, y, batch_size=16, verbose=0)
            model.predict(x, batch_size=16, verbose=0)
        return sum("a layer's own warning" in str(w.message) for w in caught)

    def build():
        inputs = keras.Input((D,))
        return keras.Model(inputs, keras.layers.Dense(1)(Warns()(inputs)))

    plain = counts(build())
    assert plain > 0
    assert counts(keras_dist.distribute(build(), two_replicas())) == plain
