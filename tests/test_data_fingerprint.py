"""The run identity a backup records: `_data.fingerprint` of the training data."""

import numpy as np
import tensorflow as tf

from keras_dist import _data


def test_equal_data_gives_equal_fingerprints_and_one_value_changes_it():
    rng = np.random.default_rng(0)
    x = {"a": rng.random((50, 3), dtype=np.float32), "b": rng.integers(0, 9, (50,))}
    y = rng.random((50, 1))
    first = _data.fingerprint(x, y)
    # Copies (other objects, a dict built in another order, a tensor) agree.
    copy = {"b": x["b"].copy(), "a": tf.constant(x["a"])}
    assert _data.fingerprint(copy, y.copy()) == first
    assert first["kind"] == "arrays"
    assert first["shapes"] == "(50, 3) float32, (50,) int64, (50, 1) float64"
    changed = y.copy()
    changed[17, 0] += 1e-6
    assert _data.fingerprint(x, changed)["digest"] != first["digest"]
    assert _data.fingerprint(x, changed)["shapes"] == first["shapes"]
    # Labels, sample weights and the dtype are part of the data.
    assert _data.fingerprint(x, y, np.ones(50)) != first
    assert _data.fingerprint(x, y.astype(np.float32)) != first
    assert _data.fingerprint(x) != first


def test_object_arrays_are_read_by_value():
    words = np.array(["a", "bb", None], dtype=object)
    assert _data.fingerprint(words) == _data.fingerprint(np.array(["a", "bb", None], object))
    assert _data.fingerprint(words) != _data.fingerprint(np.array(["a", "bc", None], object))


def test_large_arrays_are_sampled_by_rows(monkeypatch):
    monkeypatch.setattr(_data, "_HASHED_WHOLE_BYTES", 1000)
    monkeypatch.setattr(_data, "_SAMPLED_ROWS", 10)
    x = np.arange(1000, dtype=np.float32).reshape(500, 2)
    sampled = np.linspace(0, 499, 10).astype(np.int64)
    other_row = next(i for i in range(500) if i not in set(sampled))
    unsampled, on_a_sampled_row = x.copy(), x.copy()
    unsampled[other_row] = -1
    on_a_sampled_row[sampled[3]] = -1
    assert _data.fingerprint(unsampled) == _data.fingerprint(x)  # the cost bound
    assert _data.fingerprint(on_a_sampled_row) != _data.fingerprint(x)


def test_datasets_by_spec_and_cardinality_and_other_inputs_have_none():
    x = np.zeros((12, 2), np.float32)
    batched = tf.data.Dataset.from_tensor_slices(x).batch(4)
    assert _data.fingerprint(batched) == _data.fingerprint(
        tf.data.Dataset.from_tensor_slices(x + 1).batch(4))
    found = _data.fingerprint(batched)
    assert found["kind"] == "dataset" and "cardinality 3" in found["shapes"]
    assert _data.fingerprint(tf.data.Dataset.from_tensor_slices(x).batch(3)) != found
    assert _data.fingerprint(batched.repeat()) != found
    assert _data.fingerprint(iter([(x, x)])) is None


def test_an_empty_array_has_one():
    assert _data.fingerprint(np.zeros((0, 3)))["shapes"] == "(0, 3) float64"
