"""What `fit` does per step and per epoch, beyond the math: packed log
reductions, iterators created only when used and released off the training
thread, compiled agreements (speed is measured in benchmarks/, never here)."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _keras_compat
from keras_dist._keras_compat import distribute as compat_distribute
from keras_dist._keras_compat import iterators as compat_iterators


def _replica_logs():
    context = tf.distribute.get_replica_context()
    r = tf.cast(context.replica_id_in_sync_group, tf.float32)
    return {
        "loss": r + 1.0,
        "accuracy": r * 2.0,
        "precise": tf.cast(r, tf.float64) / 3.0,
        "vector": tf.stack([r, r + 1.0]),
    }


def _reduce_ops(graph) -> int:
    return sum("Collective" in op.type or "NcclAllReduce" in op.type or op.type == "AddN"
               for op in graph.get_operations())


def test_log_means_are_packed_into_one_reduction_per_dtype():
    strategy = keras_dist.resolve_strategy("mirrored")
    replicas = strategy.num_replicas_in_sync
    assert replicas == 4

    @tf.function
    def packed():
        return compat_distribute._packed_mean(strategy.run(_replica_logs), strategy)

    @tf.function
    def one_by_one():
        return tf.nest.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), strategy.run(_replica_logs)
        )

    got, want = packed(), one_by_one()
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=1e-7)
    np.testing.assert_allclose(got["loss"].numpy(), np.mean(np.arange(replicas) + 1.0))
    # loss + accuracy (float32) share one reduction; float64 and the vector
    # keep their own: 3 instead of 4.
    packed_ops = _reduce_ops(packed.get_concrete_function().graph)
    plain_ops = _reduce_ops(one_by_one.get_concrete_function().graph)
    assert plain_ops > 0
    assert packed_ops * 4 == plain_ops * 3, (packed_ops, plain_ops)


def _model():
    model = keras_dist.distribute(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)]),
        strategy="mirrored",
    )
    model.compile("sgd", "mse", metrics=["mae"])
    return model


@pytest.fixture
def created(monkeypatch):
    """Weak references to every iterator made over a distributed dataset."""
    from tensorflow.python.distribute import input_lib

    refs = []
    original = input_lib.DistributedDataset.__iter__

    def counting_iter(self):
        iterator = original(self)
        refs.append(weakref.ref(iterator))
        return iterator

    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__", counting_iter)
    return refs


def test_fit_creates_the_iterators_it_uses_and_releases_them(created):
    # Keras' epoch iterator makes a spare iterator at the end of every epoch
    # (dropped unused at the next epoch's start): keras_dist creates an
    # iterator when its first batch is read, one per epoch here, and every
    # one of them is released once fit no longer uses it.
    x = np.random.rand(64, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = _model()
    for shuffle in (True, False):
        created.clear()
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=shuffle, verbose=0)
        assert len(history.history["loss"]) == 3
        assert len(created) == 3, (shuffle, len(created))
        assert _keras_compat.wait_for_released_iterators()
        gc.collect()
        assert all(ref() is None for ref in created)


def test_a_fit_that_raises_releases_its_iterators_when_it_ends(created):
    # An exception raised through Keras' fit keeps the fit's frames (and the
    # iterators they hold) in a reference cycle while anything holds the
    # exception: freed only by a later garbage collection, an autotuned
    # iterator that has lived for minutes can take up to 60 s to tear down,
    # inside whatever runs then. keras_dist releases them when the call ends.
    x = np.random.rand(64, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stopped mid-epoch")

    model = _model()
    with pytest.raises(RuntimeError, match="mid-epoch") as raised:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Crash()],
                  validation_data=(x, y))
    assert len(created) == 1
    assert _keras_compat.wait_for_released_iterators()
    assert created[0]() is None
    # The traceback still holds fit's frames: the iterator is gone anyway.
    assert raised.value.__traceback__ is not None


def test_keras_models_inside_the_fit_keep_their_iterators():
    # The lazy iterator stands in only for the training input of a
    # DistributedModel.fit; evaluate, predict and plain Keras are untouched.
    x = np.random.rand(32, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = _model()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y))
    assert len(model.predict(x, batch_size=8, verbose=0)) == 32
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile("sgd", "mse")
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0)


def test_evaluate_and_predict_release_their_iterators_too(created):
    x = np.random.rand(40, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = _model()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y))
    # 2 training epochs + 2 validation runs: no spare iterators.
    assert len(created) == 4

    class EvaluateEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.evaluate(x, y, batch_size=8, verbose=0)

    created.clear()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[EvaluateEachEpoch()])
    assert len(created) == 4  # nested calls: still one iterator per pass
    created.clear()
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    assert len(created) == 2
    assert _keras_compat.wait_for_released_iterators()
    gc.collect()
    assert all(ref() is None for ref in created)


def test_a_fit_that_exits_the_process_exits_at_once(tmp_path):
    # `sys.exit` inside a fit (BackupAndRestore's preemption exit does this)
    # leaves iterators to be released while Python ends, when no thread can
    # start: they are released in place, and the process exits with its code.
    import subprocess
    import sys

    script = tmp_path / "exit_in_fit.py"
    script.write_text(
        "import sys\n"
        "import keras, numpy as np, keras_dist\n"
        "keras_dist.simulate_replicas(2)\n"
        "model = keras_dist.distribute(keras.Sequential([keras.Input((3,)), "
        "keras.layers.Dense(1)]), strategy='mirrored')\n"
        "model.compile('sgd', 'mse')\n"
        "class Exit(keras.callbacks.Callback):\n"
        "    def on_train_batch_end(self, batch, logs=None):\n"
        "        if batch == 2:\n"
        "            sys.exit(42)\n"
        "x = np.random.rand(64, 3).astype('float32')\n"
        "model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[Exit()])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 42, done.stdout[-2000:] + done.stderr[-2000:]


def test_only_keras_metrics_are_read_in_one_compiled_call():
    # Epoch-end metric reads are compiled under multi-worker training only
    # when every metric is Keras' own: a user's `result()` may read Python
    # state that a compiled call would freeze at its first trace.
    class Running(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="running")
            self.calls = 0

        def update_state(self, *args, **kwargs):
            self.calls += 1

        def result(self):
            return float(self.calls)

    x = np.random.rand(8, 3).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae", keras.metrics.AUC()])
    model.evaluate(x, x[:, :1], verbose=0)  # builds the compiled metrics
    assert _keras_compat.keras_metrics_only(model.metrics)
    model.compile("sgd", "mse", metrics=["mae", Running()])
    model.evaluate(x, x[:, :1], verbose=0)
    assert not _keras_compat.keras_metrics_only(model.metrics)


def test_only_input_that_tensorflow_produces_is_released_in_the_background():
    # Tearing down an iterator waits for its prefetch thread while holding
    # Python's lock; a prefetch thread that calls Python waits for that lock.
    # Such input is released where Keras drops it, never on another thread.
    from keras.src.trainers.data_adapters import get_data_adapter

    x = np.random.rand(16, 3).astype("float32")
    y = x[:, :1]

    def generator():
        while True:
            yield x[:4], y[:4]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]

    spec = (tf.TensorSpec((4, 3)), tf.TensorSpec((4, 1)))
    from_generator = tf.data.Dataset.from_generator(generator, output_signature=spec)
    slices = tf.data.Dataset.from_tensor_slices((x, y))
    fed = {
        "arrays": (x, y),
        "tf.data": slices.shuffle(16).batch(4).map(lambda a, b: (2 * a, b)).prefetch(1),
        "from_generator": from_generator,
        "py_function": slices.batch(4).map(
            lambda a, b: (tf.py_function(lambda t: t, [a], tf.float32), b)
        ),
        "zipped generator": tf.data.Dataset.zip((slices.batch(4), from_generator)),
        "interleaved generator": tf.data.Dataset.range(2).interleave(
            lambda _: from_generator
        ),
        "PyDataset": Batches(),
        "generator": generator(),
    }
    got = {}
    for name, data in fed.items():
        inputs = data if isinstance(data, tuple) else (data, None)
        adapter = get_data_adapter(*inputs, batch_size=4 if name == "arrays" else None,
                                   steps_per_epoch=4)
        got[name] = compat_iterators._tensorflow_fed(adapter)
    assert got == {"arrays": True, "tf.data": True, "from_generator": False,
                   "py_function": False, "zipped generator": False,
                   "interleaved generator": False, "PyDataset": False,
                   "generator": False}


@pytest.mark.parametrize("seed, expected", [(7, 6), (None, 3)])
def test_a_pipeline_that_reshuffles_with_a_seed_gets_keras_count_of_iterators(
    created, seed, expected
):
    # Each iterator created on a pipeline that reshuffles with a seed takes
    # the next draw of its seed generator, used or not: skipping Keras'
    # spare end-of-epoch iterator would train another order from epoch 2 on
    # than plain Keras (tests/parity_cases.py, "seeded_reshuffle"). Unseeded,
    # every pass is random anyway, and the spare one is not created.
    x = np.random.rand(64, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    tf.random.set_seed(None)  # with a global seed, an unseeded shuffle is seeded
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=seed).batch(16)
    model = _model()
    model.fit(data, epochs=3, verbose=0)
    assert len(created) == expected
    assert _keras_compat.wait_for_released_iterators()
    gc.collect()
    assert all(ref() is None for ref in created)
