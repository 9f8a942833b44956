"""Tier 1: BackupAndRestore in one process (4 logical-CPU replicas)."""

import json
import os
import re
import shutil
import signal
import threading
import time
import warnings
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from helpers import Crash
from helpers import max_abs_diff
from helpers import mlp
from helpers import regression_data
from helpers import two_replicas
from keras_dist import _backup_store as store
from keras_dist.callbacks import BackupAndRestore
from keras_dist.callbacks.backup_and_restore import PREEMPTED_EXIT_CODE

X, Y = regression_data(n=64)
EPOCHS = 3  # 8 steps per epoch at global batch 8


class Net(keras_dist.DistributedModel):
    def __init__(self, width=8, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.drop = keras.layers.Dropout(0.25)
        self.out = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.out(self.drop(self.hidden(inputs), training=training))


def make(spe=1, width=8, strategy="auto", keras_order=False):
    keras.utils.set_random_seed(1)
    if not keras_order:
        # The weights seeded, TensorFlow's global seed not: keras_dist draws
        # and records its own shuffle seed, reshuffling every epoch. With it
        # (`keras_order`), arrays train in Keras' own order.
        tf.random.set_seed(None)
    model = Net(width=width, strategy=strategy)
    model.compile(keras.optimizers.Adam(0.02), "mse", metrics=["mae"],
                  steps_per_execution=spe)
    return model


def fit_args(source):
    if source == "numpy":
        return dict(x=X, y=Y, batch_size=8, shuffle=True)
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(64, seed=3).batch(8)
    return dict(x=ds)


_REFERENCE = {}


def reference_weights():
    """The uninterrupted numpy run's final weights, computed once."""
    if "numpy" not in _REFERENCE:
        model, history = reference("numpy")
        _REFERENCE["numpy"] = model.get_weights()
        _REFERENCE["numpy history"] = history.history
    return _REFERENCE["numpy"]


def reference_history():
    """The uninterrupted numpy run's logged loss and mae per epoch."""
    reference_weights()
    return _REFERENCE["numpy history"]


def assert_logs_as_uninterrupted(history, epochs):
    """The last `epochs` epochs logged as the uninterrupted run logged them."""
    expected = reference_history()
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected[key][-epochs:], rtol=1e-5)


def reference(source, spe=1, callbacks=(), keras_order=False):
    model = make(spe, keras_order=keras_order)
    history = model.fit(**fit_args(source), epochs=EPOCHS, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def crash(backup_dir, source, at, spe=1, save_freq=2, callbacks=(), keras_order=False):
    model = make(spe, keras_order=keras_order)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(**fit_args(source), epochs=EPOCHS, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=save_freq), Crash(at), *callbacks
        ])


@pytest.mark.parametrize(
    "source,spe,save_freq,keras_order",
    [("numpy", 2, 3, False), ("numpy", 1, 3, True), ("dataset", 1, "epoch", False)],
    ids=["numpy-2-3", "numpy-keras-order", "dataset-1-epoch"],
)
def test_two_crashes_resume_to_the_uninterrupted_weights(tmp_path, source, spe, save_freq,
                                                         keras_order):
    ref, ref_history = reference(source, spe, keras_order=keras_order)
    backup_dir = str(tmp_path / "b")
    for at in (13, 20):  # epochs 2 and 3
        crash(backup_dir, source, at=at, spe=spe, save_freq=save_freq,
              keras_order=keras_order)
    model = make(spe, keras_order=keras_order)
    history = model.fit(**fit_args(source), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, save_freq=save_freq)])
    assert max_abs_diff(ref.get_weights(), model.get_weights()) < 1e-6
    assert model.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy() == 24
    # The resumed epochs report every number the uninterrupted run logged
    # (loss and mae: the same running means).
    done = len(history.history["loss"])
    assert sorted(history.history) == sorted(ref_history.history) == ["loss", "mae"]
    for key in ref_history.history:
        np.testing.assert_allclose(
            history.history[key], ref_history.history[key][-done:], rtol=1e-6
        )
    assert not os.path.exists(backup_dir)


def test_an_unbuilt_subclassed_model_on_one_device_resumes(tmp_path):
    """On the default strategy Keras builds a model at its first step, after
    `on_train_begin` restores the backup: the variables must exist first."""
    def one_device():
        model = make(strategy="default")
        assert not model.built  # a fresh subclassed model, as after a restart
        return model

    expected = one_device()
    expected.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0)
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="simulated crash"):
        one_device().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=3), Crash(13)])
    model = one_device()
    history = model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, save_freq=3)])
    assert len(history.history["loss"]) == 2  # resumed in epoch 2
    assert int(model.optimizer.iterations.numpy()) == 24
    assert max_abs_diff(expected.get_weights(), model.get_weights()) < 1e-6


def global_seed_state():
    """The state of Keras' global SeedGenerator (None: the process has none)."""
    from keras_dist import _keras_compat

    found = _keras_compat.global_seed_variables()
    return found[0].numpy().tolist() if found else None


@pytest.mark.parametrize("made_in", ["the backed-up run", "the resumed run"])
def test_a_resume_does_not_depend_on_the_process_having_made_keras_global_seed(
        tmp_path, made_in):
    """Keras' global SeedGenerator belongs to the process (its first
    unseeded `keras.random` call makes it), not to the model: a resumed
    run that made it where the backed-up run had not, or the reverse,
    resumes as the uninterrupted run (weights and every logged number).
    Where the backup holds its state the stream goes on from there; where
    it does not, the process's own is left as it was."""
    backup_dir = str(tmp_path / "b")
    model = make()  # keras.utils.set_random_seed: no global SeedGenerator yet
    if made_in == "the backed-up run":
        keras.random.uniform((3,))  # the process's first unseeded draw
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=3), Crash(13)])
    # Training draws nothing from it: the state the backup holds (or none).
    backed_up = global_seed_state()
    assert (backed_up is not None) == (made_in == "the backed-up run")
    next_draw = keras.random.uniform((3,)).numpy() if backed_up else None

    model = make()  # as a fresh process: no global SeedGenerator
    if made_in == "the resumed run":
        keras.random.uniform((3,))
    before = global_seed_state()
    history = model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir, save_freq=3)])
    after = global_seed_state()
    if made_in == "the backed-up run":
        assert before is None and after == backed_up
        np.testing.assert_array_equal(keras.random.uniform((3,)).numpy(), next_draw)
    else:
        assert before is not None and after == before
    assert len(history.history["loss"]) == 2  # resumed in epoch 2
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6
    assert_logs_as_uninterrupted(history, 2)


def test_an_unbuilt_plain_model_gets_a_clear_error_and_keeps_its_backup(tmp_path):
    class Plain(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

    def model():
        plain = Plain()
        plain.compile(keras.optimizers.SGD(0.05), "mse")
        return plain

    backup_dir = str(tmp_path / "b")
    backup = BackupAndRestore(backup_dir, save_freq=1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model().fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                    callbacks=[backup, Crash(3)])
    backup.wait_until_finished()  # a plain fit that raised: its last write goes on
    saved = committed(backup_dir)
    assert saved == [3, 2]
    with pytest.raises(ValueError, match="the model has no variables to restore the backup"):
        model().fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                    callbacks=[BackupAndRestore(backup_dir, save_freq=1)])
    assert committed(backup_dir) == saved  # nothing lost


def test_numpy_shuffle_differs_between_epochs():
    """Keras 3.15 reuses one permutation per epoch once a seed is set."""
    keras.utils.set_random_seed(0)
    from keras_dist import _data

    strategy = keras_dist.resolve_strategy("default")
    dataset = _data.array_dataset(
        strategy, np.arange(16), None, None, 16, True, seed=5
    )
    orders = [next(iter(dataset))[0].numpy().tolist() for _ in range(3)]
    assert len({tuple(o) for o in orders}) == 3
    assert all(sorted(o) == list(range(16)) for o in orders)


def counting_iterators():
    """Counts the iterators made on any dataset, distributed or not."""
    made = []
    classes = [tf.data.Dataset, tf.distribute.DistributedDataset]
    classes += [type(two_replicas().experimental_distribute_dataset(
        tf.data.Dataset.range(2).batch(2)))]
    patches = []
    for cls in dict.fromkeys(classes):
        original = cls.__iter__

        def counted(self, original=original):
            made.append(1)
            return original(self)

        patches.append(mock.patch.object(cls, "__iter__", counted))
    return made, patches


def distributed_order(strategy, distributed) -> list:
    """The sample indices of a fresh pass's first batch, replica by replica."""
    batch = next(iter(distributed))
    indices = batch[0] if isinstance(batch, tuple) else batch
    return [int(v) for part in strategy.experimental_local_results(indices)
            for v in part.numpy()]


def test_a_resumed_cursor_reaches_any_pass_of_shuffled_arrays_without_an_iterator():
    """keras_dist's own shuffled arrays order a pass by the seed and the
    pass's number: positioning at pass 1,000 makes no iterator at all, and
    the distributed input then takes the order it takes after that many
    passes (checked against real distributed passes for the first ones)."""
    from keras_dist import _data

    strategy = two_replicas()

    def cursor_and_input():
        cursor = _data.DataCursor("arrays", persistent=False)
        dataset = _data.array_dataset(strategy, np.arange(16), None, None, 16, True,
                                      seed=5, cursor=cursor)
        return cursor, strategy.experimental_distribute_dataset(dataset)

    cursor, distributed = cursor_and_input()
    walked = []
    for _ in range(6):  # as fit makes its passes
        cursor.on_iterator_created()
        walked.append(distributed_order(strategy, distributed))
    assert all(sorted(order) == list(range(16)) for order in walked)
    assert len({tuple(order) for order in walked}) == 6

    made, patches = counting_iterators()
    for target in (3, 1000):
        cursor, distributed = cursor_and_input()
        for patch in patches:
            patch.start()
        try:
            assert cursor.advance_to(target)
        finally:
            for patch in patches:
                patch.stop()
        assert made == [] and cursor.created == target
        cursor.on_iterator_created()  # the resumed pass
        resumed = distributed_order(strategy, distributed)
        if target == 3:
            assert resumed == walked[3]
        else:
            assert sorted(resumed) == list(range(16)) and resumed not in walked
    cursor, _ = cursor_and_input()
    assert cursor.advance_to(7) and not cursor.advance_to(6)  # never backwards


def test_a_resumed_cursor_positions_an_input_in_one_order_by_its_count_alone():
    """Arrays in Keras' own order (TensorFlow's global seed set) and a
    dataset without a seeded reshuffle take every pass in one order: the
    count is set, no pass replayed."""
    from keras_dist import _data
    from keras_dist import _keras_compat

    strategy = two_replicas()
    arrays = _data.DataCursor("arrays", persistent=False)
    dataset = _data.array_dataset(strategy, np.arange(16), None, None, 16, True, seed=None,
                                  order=np.arange(16)[::-1], cursor=arrays)
    arrays.dataset = strategy.experimental_distribute_dataset(dataset)
    pipeline = tf.data.Dataset.range(16).shuffle(16, seed=3, reshuffle_each_iteration=False)
    fixed = _data.DataCursor("dataset", persistent=False)
    fixed.undistributed = pipeline.batch(16)
    fixed.dataset = strategy.experimental_distribute_dataset(fixed.undistributed)
    fixed.reorders = _keras_compat.reorders_each_pass(fixed.undistributed)
    assert not fixed.reorders
    assert _keras_compat.reorders_each_pass(
        tf.data.Dataset.range(16).shuffle(16, seed=3).batch(16))
    made, patches = counting_iterators()
    for patch in patches:
        patch.start()
    try:
        assert arrays.advance_to(1000) and fixed.advance_to(1000)
    finally:
        for patch in patches:
            patch.stop()
    assert made == [] and arrays.created == fixed.created == 1000
    assert distributed_order(strategy, arrays.dataset) == list(range(15, -1, -1))


def test_a_mid_epoch_backup_from_the_earlier_order_warns_on_resume(tmp_path):
    """A backup written before each pass was ordered by its number (no
    `order` in its state) resumes mid-epoch with a warning that the
    resumed epoch's samples may repeat; today's backups resume silently."""
    backup_dir = str(tmp_path / "b")
    backup = BackupAndRestore(backup_dir, save_freq=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                   callbacks=[backup, Crash(11)])
    backup.wait_until_finished()
    newest = os.path.join(backup_dir, store.backup_name(committed(backup_dir)[0]))
    state = store.verify(newest)
    assert state["position"]["step"] > 0 and state["data"]["order"]

    def resume():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
                BackupAndRestore(str(tmp_path / "copy"), delete_checkpoint=False)])
        return [str(w.message) for w in caught if "earlier keras_dist" in str(w.message)]

    shutil.copytree(backup_dir, tmp_path / "copy")
    assert resume() == []
    shutil.rmtree(tmp_path / "copy")
    shutil.copytree(backup_dir, tmp_path / "copy")
    copied = os.path.join(tmp_path / "copy", os.path.basename(newest), "state.json")
    with open(copied) as f:
        old = json.load(f)
    del old["data"]["order"]
    with open(copied, "w") as f:
        json.dump(old, f)
    store.seal(os.path.dirname(copied))
    [message] = resume()
    assert f"resumes at step {state['position']['step']}" in message


def test_a_resumed_cursor_replays_a_shuffled_dataset_on_the_dataset_itself():
    """A user's seeded tf.data shuffle draws its pass's order when an
    iterator is made: the passes already trained are replayed on the
    undistributed dataset (one draw of the same seed generator each), and
    no distributed iterator is made to get there."""
    from keras_dist import _data

    strategy = two_replicas()

    def orders(advance):
        dataset = tf.data.Dataset.range(16).shuffle(
            16, seed=3, reshuffle_each_iteration=True).map(lambda v: v * 2).batch(16)
        cursor = _data.DataCursor("dataset", persistent=False)
        cursor.undistributed = dataset
        cursor.dataset = strategy.experimental_distribute_dataset(dataset)
        made, patches = counting_iterators()
        if advance:
            original = type(cursor.dataset).__iter__
            with mock.patch.object(type(cursor.dataset), "__iter__",
                                   lambda self: made.append(1) or original(self)):
                assert cursor.advance_to(4)
            assert made == [] and cursor.created == 4
        else:
            for _ in range(4):
                iter(cursor.dataset)
        return [distributed_order(strategy, cursor.dataset) for _ in range(2)]

    replayed = orders(advance=False)
    assert orders(advance=True) == replayed
    assert all(sorted(order) == list(range(0, 32, 2)) for order in replayed)
    assert replayed[0] != replayed[1]


def committed(backup_dir):
    return store.list_backups(backup_dir)


def corrupt_truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def corrupt_empty(path):
    open(path, "wb").close()


def corrupt_flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def corrupt_manifest_entry(path):
    # Parseable JSON, an entry of the wrong type.
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"]["state.json"] = ["bytes", 12]
    with open(path, "w") as f:
        json.dump(manifest, f)


def add_unlisted(path):
    # A file the manifest does not list (the manifest edited, or a stray copy).
    with open(path, "wb") as f:
        f.write(b"\x00garbage")


def resealed(damage):
    """A damage the checksums cannot see: the manifest is rewritten after it."""

    def apply(path):
        damage(path)
        store.seal(os.path.dirname(path))

    return apply


def bad_position(path):
    with open(path) as f:
        state = json.load(f)
    state["position"]["step"] = "7"
    with open(path, "w") as f:
        json.dump(state, f)


def no_variables(path):
    with open(path) as f:
        state = json.load(f)
    state["variables"]["optimizer"] = {"iterations": 3}
    with open(path, "w") as f:
        json.dump(state, f)


# A data shard deleted and dropped from the manifest: every listed file is
# intact, the checkpoint's index still parses, the restore would fail.
DELETED_RESEALED = resealed(os.remove)


@pytest.fixture(scope="module")
def crashed_once(tmp_path_factory):
    """Backups of a run that crashed after 11 steps (two committed)."""
    backup_dir = str(tmp_path_factory.mktemp("crashed") / "b")
    crash(backup_dir, "numpy", at=11)
    return backup_dir


@pytest.mark.parametrize(
    "target,damage",
    [
        ("variables.data-00000-of-00001", corrupt_truncate),
        ("variables.data-00000-of-00001", corrupt_empty),
        ("variables.index", corrupt_flip),
        ("state.json", corrupt_flip),
        ("MANIFEST.json", corrupt_manifest_entry),
        ("variables.unlisted", add_unlisted),
        ("variables.index", resealed(corrupt_flip)),
        ("variables.index", resealed(corrupt_truncate)),
        ("state.json", resealed(bad_position)),
        ("state.json", resealed(no_variables)),
        ("variables.data-00000-of-00001", DELETED_RESEALED),
        # Found as the restore reads the shard (TensorFlow's per-tensor
        # CRC32C), before any variable changes; resealed, too.
        ("variables.data-00000-of-00001", corrupt_flip),
        ("variables.data-00000-of-00001", resealed(corrupt_flip)),
    ],
    ids=["truncated", "zero-byte", "bit-flip", "state", "manifest-entry", "unlisted",
         "index-resealed", "index-truncated-resealed", "state-position", "state-variables",
         "data-shard-deleted-resealed", "data-bit-flip", "data-bit-flip-resealed"],
)
def test_damaged_latest_backup_falls_back_to_previous(tmp_path, crashed_once, target, damage):
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    newest, previous = committed(backup_dir)
    bad = os.path.join(backup_dir, store.backup_name(newest), target)
    damage(bad)
    model = make()
    with pytest.warns(UserWarning, match="skipping damaged backup") as record:
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    if damage is DELETED_RESEALED:  # the manifest no longer names the shard
        bad = os.path.join(os.path.dirname(bad), "variables.data-*: data shard missing")
    assert any(bad in str(w.message) for w in record), [str(w.message) for w in record]
    # The previous backup resumes exactly too.
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6


def test_a_damaged_data_shard_and_no_backup_before_it_stop_the_fit(tmp_path, crashed_once):
    """The only backup's data fails its checksums as it is read: the fit
    stops before any step, naming it, and nothing is deleted."""
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    newest, previous = committed(backup_dir)
    shutil.rmtree(os.path.join(backup_dir, store.backup_name(previous)))
    damaged = os.path.join(backup_dir, store.backup_name(newest))
    corrupt_flip(os.path.join(damaged, "variables.data-00000-of-00001"))
    before = sorted(os.listdir(damaged))
    model = make()
    with pytest.warns(UserWarning, match="skipping damaged backup"), \
            pytest.raises(ValueError, match="holds no intact one before it") as error:
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    assert damaged in str(error.value) and "move the damaged backup out" in str(error.value)
    assert model.optimizer.iterations.numpy() == 0  # not a step trained
    assert committed(backup_dir) == [newest] and sorted(os.listdir(damaged)) == before


def plain_model(seed, features, hidden, learning_rate):
    """A plain keras.Sequential regression model, compiled (Adam, mse)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(hidden),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(learning_rate), "mse")
    return model


def test_a_plain_keras_model_falls_back_from_a_damaged_data_shard(tmp_path):
    """keras.Model.fit with keras_dist's callback: the shard read with its
    checksums there too; the previous backup resumes."""
    backup_dir = str(tmp_path / "b")

    def plain():
        return plain_model(seed=3, features=4, hidden=3, learning_rate=0.01)

    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    plain().fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False,
                                            max_to_keep=3)])
    final, newest, previous = committed(backup_dir)  # epochs 2 (the end), 2, 1
    shutil.rmtree(os.path.join(backup_dir, store.backup_name(final)))
    corrupt_flip(os.path.join(backup_dir, store.backup_name(newest),
                              "variables.data-00000-of-00001"))
    reference = plain()
    reference.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
    model = plain()
    model.build((None, 4))
    with pytest.warns(UserWarning, match="skipping damaged backup .*variables.data"):
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
                            callbacks=[BackupAndRestore(backup_dir)])
    assert history.epoch == [1, 2]  # the epoch of the previous backup, resumed
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    # Every logged number of the resumed epochs is the uninterrupted run's.
    assert np.allclose(history.history["loss"], reference.history.history["loss"][1:],
                       rtol=0, atol=1e-6)


def test_unreadable_file_falls_back_to_previous(tmp_path, crashed_once, monkeypatch):
    """A file that cannot be read (PermissionError) means 'damaged'."""
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    newest, _ = committed(backup_dir)
    bad = os.path.join(backup_dir, store.backup_name(newest), "variables.index")
    real = store._sha256

    def sha256(path):
        if path == bad:
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(store, "_sha256", sha256)
    model = make()
    with pytest.warns(UserWarning, match="variables.index: unreadable.*Permission denied"):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6


def test_early_stopping_weights_missing_from_arrays_is_damage(tmp_path):
    backup_dir = str(tmp_path / "b")
    model = make()
    model.fit(**fit_args("numpy"), epochs=2, verbose=0, callbacks=[
        BackupAndRestore(backup_dir, delete_checkpoint=False),
        keras.callbacks.EarlyStopping("loss", patience=9, restore_best_weights=True)])
    directory = os.path.join(backup_dir, store.backup_name(committed(backup_dir)[0]))
    state = store.verify(directory)
    (key,) = [k for k, v in state["callbacks"].items() if "best_weights" in v]
    arrays = dict(np.load(os.path.join(directory, "arrays.npz")))
    arrays.pop(f"{key}/best_weights/0")
    np.savez(os.path.join(directory, "arrays.npz"), **arrays)
    store.seal(directory)
    with pytest.raises(store.CorruptBackupError, match="arrays.npz lacks"):
        store.verify(directory)


def test_backups_are_atomic_and_bounded(tmp_path):
    backup_dir = str(tmp_path / "b")
    seen = []
    backup = BackupAndRestore(backup_dir, save_freq=1, delete_checkpoint=False, max_to_keep=3)

    class Watch(keras.callbacks.Callback):
        # A backup due at a batch is started after every callback's
        # on_train_batch_end: look when the next batch begins, once written.
        def on_train_batch_begin(self, batch, logs=None):
            backup.wait_until_finished()
            names = os.listdir(backup_dir)
            seen.append(len(committed(backup_dir)))
            assert not [n for n in names if n.startswith(store.TMP_PREFIX)]
            for sequence in committed(backup_dir):
                store.verify(os.path.join(backup_dir, store.backup_name(sequence)))
            if committed(backup_dir):  # (the run's .lock is there from the start)
                with open(os.path.join(backup_dir, store.POINTER)) as f:
                    assert f.read().strip() == store.backup_name(committed(backup_dir)[0])

    model = make()
    model.fit(**fit_args("numpy"), epochs=2, verbose=0, callbacks=[backup, Watch()])
    assert max(seen) == 3 and seen[:4] == [0, 1, 2, 3]
    state = store.verify(os.path.join(backup_dir, store.backup_name(committed(backup_dir)[0])))
    assert state["position"]["epoch"] == 2 and state["position"]["step"] == 0
    # A leftover half-written backup is ignored and cleaned up.
    os.makedirs(os.path.join(backup_dir, ".tmp-backup-00000099-1"))
    model = make()
    model.fit(**fit_args("numpy"), epochs=2, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=1)])
    assert not os.path.exists(backup_dir)


def test_callback_states_survive_a_crash(tmp_path):
    class Counter(keras.callbacks.Callback):
        """A user callback with the get_state/set_state protocol."""

        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            if "loss" in logs and logs is not None:
                self.batches += 1

        def get_state(self):
            return {"batches": self.batches}

        def set_state(self, state):
            self.batches = state["batches"]

    def callbacks():
        return [
            keras.callbacks.EarlyStopping("loss", patience=9, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau("loss", patience=0, factor=0.5),
        ]

    ref_cbs = callbacks()
    ref, _ = reference("numpy", callbacks=ref_cbs)
    backup_dir = str(tmp_path / "b")
    crash(backup_dir, "numpy", at=20, save_freq="epoch", callbacks=callbacks())
    cbs = callbacks()
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir), *cbs])
    assert cbs[0].best == pytest.approx(ref_cbs[0].best, rel=1e-6)
    assert cbs[0].best_epoch == ref_cbs[0].best_epoch
    assert cbs[0].wait == ref_cbs[0].wait
    assert cbs[1].best == pytest.approx(ref_cbs[1].best, rel=1e-6)
    assert cbs[1].wait == ref_cbs[1].wait
    assert model.optimizer.learning_rate.numpy() == pytest.approx(
        ref.optimizer.learning_rate.numpy())
    assert max_abs_diff(ref.get_weights(), model.get_weights()) < 1e-6

    counter = Counter()
    backup_dir = str(tmp_path / "c")
    model = make()
    with pytest.raises(RuntimeError):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
            counter, BackupAndRestore(backup_dir, save_freq=4), Crash(10)])
    assert counter.batches == 10
    resumed = Counter()
    make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
               callbacks=[resumed, BackupAndRestore(backup_dir, save_freq=4)])
    assert resumed.batches == 24  # 8 restored + 16 trained


class Tally(keras.callbacks.Callback):
    """A user callback with state, told apart from its twin by `monitor`."""

    def __init__(self, monitor, weight):
        super().__init__()
        self.monitor, self.weight, self.total = monitor, weight, 0

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None and "loss" in logs:
            self.total += self.weight

    def get_state(self):
        return {"total": self.total}

    def set_state(self, state):
        self.total = state["total"]


def test_reordered_callbacks_get_their_own_states_back(tmp_path):
    """Saved callback states are keyed by class and configuration, not by
    list position: a resumed fit may list its callbacks in another order."""
    backup_dir = str(tmp_path / "b")
    first = [Tally("loss", 1), Tally("mae", 100)]
    model = make()
    with pytest.raises(RuntimeError):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
            *first, BackupAndRestore(backup_dir, save_freq=4), Crash(10)])
    assert [t.total for t in first] == [10, 1000]
    loss, mae = Tally("loss", 1), Tally("mae", 100)
    make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
               callbacks=[BackupAndRestore(backup_dir, save_freq=4), mae, loss])
    assert (loss.total, mae.total) == (24, 2400)  # 8 restored + 16 trained


def test_callbacks_listed_after_it_are_saved_after_their_batch_hooks(tmp_path):
    """A backup is written once every callback has seen the batch: a
    stateful callback listed after BackupAndRestore is not one batch behind."""
    backup_dir = str(tmp_path / "b")
    tally = Tally("loss", 1)
    with pytest.raises(RuntimeError):
        make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=4), tally, Crash(10)])
    assert tally.total == 10
    resumed = Tally("loss", 1)
    make().fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
               callbacks=[BackupAndRestore(backup_dir, save_freq=4), resumed])
    assert resumed.total == 24  # 8 restored + 16 trained


def test_lambda_callback_hooks_survive_fits_with_it(tmp_path):
    """The batch hooks it wraps for a fit are put back as they were,
    including hooks set on the instance (LambdaCallback)."""
    seen = []
    spy = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(("begin", batch)),
        on_train_batch_end=lambda batch, logs: seen.append(("end", batch)),
    )
    model = make()
    for _ in range(2):
        seen.clear()
        model.fit(**fit_args("numpy"), epochs=1, verbose=0, callbacks=[
            BackupAndRestore(str(tmp_path / "b"), save_freq=4), spy])
        assert seen == [(kind, b) for b in range(8) for kind in ("begin", "end")]
    seen.clear()
    model.fit(**fit_args("numpy"), epochs=1, verbose=0, callbacks=[spy])
    assert len(seen) == 16


def test_a_fit_that_raised_leaves_no_live_signal_handler(tmp_path):
    """A plain keras.Model's fit that raises never reaches on_train_end:
    the handler it left behind passes a later signal on to the handler that
    was there before, instead of swallowing it."""
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        model = keras.Sequential([keras.Input((X.shape[1],)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        with pytest.raises(RuntimeError, match="simulated crash"):
            model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[
                BackupAndRestore(str(tmp_path / "b"), preemption_signals=[signal.SIGUSR1]),
                Crash(2),
            ])
        signal.raise_signal(signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not None
        signal.raise_signal(signal.SIGUSR1)
        assert received == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigterm_saves_and_exits_then_resumes(tmp_path):
    backup_dir = str(tmp_path / "b")
    before = signal.getsignal(signal.SIGTERM)

    class Term(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 13:
                os.kill(os.getpid(), signal.SIGTERM)

    model = make()
    with pytest.raises(SystemExit) as exit_info:
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[Term(), BackupAndRestore(backup_dir)])
    assert exit_info.value.code == PREEMPTED_EXIT_CODE == 42
    assert signal.getsignal(signal.SIGTERM) is before
    state = store.verify(os.path.join(backup_dir, store.backup_name(committed(backup_dir)[0])))
    assert (state["position"]["epoch"], state["position"]["step"]) == (1, 5)
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir)])
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6


def held_seal(monkeypatch, release: threading.Event, seconds: float = 30.0) -> dict:
    """Holds the first backup's write before its manifest (on the writing
    thread) until `release` is set, at most `seconds`; says whether it was
    released (a write on the training thread never is: the release comes
    from a later batch)."""
    seal, held = store.seal, {}

    def sealing(directory):
        if not held:
            held["released"] = release.wait(seconds)
            held["thread"] = threading.current_thread().name
        return seal(directory)

    monkeypatch.setattr(store, "seal", sealing)
    return held


def checkpoint_values(backup_dir, sequence, count):
    """The first `count` model variables stored in backup `sequence`."""
    reader = tf.train.load_checkpoint(
        os.path.join(backup_dir, store.backup_name(sequence), "variables"))
    return [reader.get_tensor(f"model/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(count)]


def test_a_save_copies_its_step_and_writes_while_the_next_steps_train(tmp_path, monkeypatch):
    backup_dir = str(tmp_path / "b")
    two_steps_later = threading.Event()
    held = held_seal(monkeypatch, two_steps_later)
    at_step = {}

    class Watch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 5:  # while the backup of batch 3 is being written
                two_steps_later.set()

        def on_train_batch_end(self, batch, logs=None):
            at_step[batch] = [np.array(v) for v in self.model.variables]

    model = make()
    backup = BackupAndRestore(backup_dir, save_freq=4, delete_checkpoint=False, max_to_keep=3)
    model.fit(**fit_args("numpy"), epochs=1, verbose=0, callbacks=[backup, Watch()])
    assert held == {"released": True, "thread": "keras_dist-backup-write"}
    assert committed(backup_dir) == [3, 2, 1]  # batches 3 and 7, then the end's
    # Written while batches 4 and 5 trained, it holds batch 3's state.
    stored = checkpoint_values(backup_dir, 1, len(at_step[3]))
    assert max_abs_diff(stored, at_step[3]) == 0
    assert max_abs_diff(stored, at_step[5]) > 1e-4
    state = store.verify(os.path.join(backup_dir, store.backup_name(1)))
    assert (state["position"]["epoch"], state["position"]["step"]) == (0, 4)
    # The run resumed from it ends at the uninterrupted run's weights.
    for sequence in (3, 2):
        shutil.rmtree(os.path.join(backup_dir, store.backup_name(sequence)))
    with open(os.path.join(backup_dir, store.POINTER), "w") as f:
        f.write(store.backup_name(1))
    monkeypatch.undo()
    resumed = make()
    history = resumed.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                          callbacks=[BackupAndRestore(backup_dir)])
    assert max_abs_diff(reference_weights(), resumed.get_weights()) < 1e-6
    assert_logs_as_uninterrupted(history, EPOCHS)  # epoch 1 from batch 3's metrics


@pytest.mark.parametrize("same_callback", [True, False])
def test_a_fit_after_one_that_raised_resumes_from_its_last_write(
        same_callback, tmp_path, monkeypatch, capsys):
    """A plain Keras fit that raises has no end hook: its last write may
    still be in flight when the next fit on the directory (the same
    callback, or a new one) chooses a backup."""
    backup_dir = str(tmp_path / "b")
    released = threading.Event()
    held = held_seal(monkeypatch, released)

    def plain():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((X.shape[1],)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    reference = plain()
    expected = reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    backup = BackupAndRestore(backup_dir, save_freq=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        plain().fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[backup, Crash(3)])  # the save of step 2 is held
    assert not held and committed(backup_dir) == []
    threading.Timer(0.5, released.set).start()
    model = plain()
    if not same_callback:
        backup = BackupAndRestore(backup_dir, save_freq=2)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=[backup])
    assert held["released"]
    assert "BackupAndRestore: restored" in capsys.readouterr().out
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    np.testing.assert_allclose(history.history["loss"], expected["loss"], rtol=1e-5)


def test_a_preemption_during_a_write_waits_for_it_and_saves_once(tmp_path, monkeypatch, capsys):
    backup_dir = str(tmp_path / "b")
    signalled = threading.Event()
    held = held_seal(monkeypatch, signalled)

    class Term(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 13:  # backup 1 in flight
                os.kill(os.getpid(), signal.SIGTERM)
                threading.Timer(0.5, signalled.set).start()  # once the save waits

    model = make()
    with pytest.raises(SystemExit) as exit_info:
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[Term(), BackupAndRestore(backup_dir, save_freq=12)])
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    assert held["released"]
    assert committed(backup_dir) == [2, 1]  # the write in flight, then the preemption's
    positions = [store.verify(os.path.join(backup_dir, store.backup_name(n)))["position"]
                 for n in (1, 2)]
    assert [(p["epoch"], p["step"]) for p in positions] == [(1, 4), (1, 5)]
    assert capsys.readouterr().out.count("preemption signal received; backup saved") == 1
    monkeypatch.undo()
    model = make()
    history = model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                        callbacks=[BackupAndRestore(backup_dir)])
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6
    assert_logs_as_uninterrupted(history, EPOCHS - 1)  # from epoch 2, step 5


def test_two_fits_in_a_row_and_a_fit_without_it_leak_nothing(tmp_path):
    backup_dir = str(tmp_path / "b")
    backup = BackupAndRestore(backup_dir, save_freq=3)
    model = make()
    train_function = None
    handler = signal.getsignal(signal.SIGTERM)
    for _ in range(2):
        history = model.fit(**fit_args("numpy"), epochs=2, verbose=0, callbacks=[backup])
        assert len(history.history["loss"]) == 2
        assert model._initial_epoch is None
        assert signal.getsignal(signal.SIGTERM) is handler
        assert not os.path.exists(backup_dir)
        train_function = train_function or model.train_function
        assert model.train_function is train_function
    # A crashed run leaves a backup; a later fit without the callback ignores it.
    with pytest.raises(RuntimeError):
        model.fit(**fit_args("numpy"), epochs=3, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=2),
                             Crash(model.optimizer.iterations.numpy() + 5)])
    assert signal.getsignal(signal.SIGTERM) is handler
    assert model.train_function is train_function
    history = model.fit(**fit_args("numpy"), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert committed(backup_dir)


def test_plain_keras_model_resumes_unshuffled_input(tmp_path):
    def plain():
        return plain_model(seed=2, features=6, hidden=4, learning_rate=0.02)

    ref = plain()
    ref.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    backup_dir = str(tmp_path / "b")
    model = plain()
    with pytest.raises(RuntimeError):
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=3), Crash(11)])
    model = plain()
    with pytest.warns(UserWarning, match="plain keras.Model"):
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=3)])
    assert max_abs_diff(ref.get_weights(), model.get_weights()) < 1e-6


def test_save_every_seconds_saves_on_time(tmp_path):
    backup_dir = str(tmp_path / "b")
    sequences = []
    backup = BackupAndRestore(backup_dir, save_freq="epoch", save_every_seconds=1e-9)

    class Watch(keras.callbacks.Callback):
        # A backup due at a batch is started after every callback's
        # on_train_batch_end: look when the next batch begins, once written.
        def on_train_batch_begin(self, batch, logs=None):
            backup.wait_until_finished()
            sequences.append(committed(backup_dir)[:1])

    make().fit(**fit_args("numpy"), epochs=1, verbose=0, callbacks=[backup, Watch()])
    # Every step boundary is past the (tiny) interval: one backup per step.
    assert [s[0] if s else 0 for s in sequences] == list(range(0, 8))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(save_freq=False), ValueError, r"Expected \"epoch\" or a positive integer. Received: save_freq=False"),
        (dict(save_freq=0), ValueError, "Received: save_freq=0"),
        (dict(save_freq="batch"), ValueError, "Received: save_freq='batch'"),
        (dict(max_to_keep=0), ValueError, "Received: max_to_keep=0"),
        (dict(double_checkpoint=True, max_to_keep=1), ValueError, "max_to_keep >= 2"),
        (dict(double_checkpoint="yes"), TypeError, "double_checkpoint='yes'"),
        (dict(save_every_seconds=-1), ValueError, "save_every_seconds=-1"),
        (dict(preemption_signals=[signal.SIGKILL]), ValueError, "SIGKILL cannot be caught"),
        (dict(preemption_signals=[12345]), ValueError, r"Received: preemption_signals=\[12345\], whose 12345 is not one"),
        (dict(preemption_signals="SIGTERM"), ValueError, r"Expected a signal or a sequence of signals, such as signal.SIGTERM .* Received: preemption_signals='SIGTERM'"),
        (dict(preemption_signals=15.0), ValueError, "Received: preemption_signals=15.0"),
        (dict(preemption_signals=[True]), ValueError, "whose True is not one"),
        (dict(save_every_seconds=float("inf")), ValueError, "save_every_seconds=inf"),
    ],
)
def test_bad_arguments_are_rejected(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        BackupAndRestore(str(tmp_path), **kwargs)


def test_one_signal_is_taken_as_the_one_preemption_signal(tmp_path):
    assert BackupAndRestore(str(tmp_path), preemption_signals=signal.SIGUSR1).preemption_signals == (
        signal.SIGUSR1,)
    assert BackupAndRestore(str(tmp_path), preemption_signals=None).preemption_signals == ()


def test_bad_backup_dir_is_rejected_before_any_step(tmp_path):
    # Keras' error for a missing directory, whichever way it is missing.
    for empty in ("", None):
        with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
            keras.callbacks.BackupAndRestore(empty)
        with pytest.raises(
            ValueError,
            match=f"Empty `backup_dir` argument passed. Expected a non-empty path. "
            f"Received: backup_dir={empty!r}",
        ):
            BackupAndRestore(empty)
    with pytest.raises(TypeError, match="backup_dir=3"):
        BackupAndRestore(3)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path in (a_file, a_file / "sub"):
        model = make()
        with pytest.raises(ValueError, match=f"writable directory. Received: backup_dir='{path}'"):
            model.fit(**fit_args("numpy"), epochs=1, verbose=0,
                      callbacks=[BackupAndRestore(str(path))])
        assert model.optimizer.iterations.numpy() == 0


def test_backup_of_another_model_is_refused_by_name(tmp_path, crashed_once):
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    saved = os.listdir(backup_dir)
    model = make(width=16)
    with pytest.raises(ValueError, match=r"written by a different model.*different shape or dtype: .*kernel \(model \[6, 16\]"):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir)])
    assert model.optimizer.iterations.numpy() == 0
    assert os.listdir(backup_dir) == saved  # nothing saved is lost


def test_changed_fit_arguments_are_reported(tmp_path, crashed_once):
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    # The same data, more epochs: the same run, resumed with a warning.
    with pytest.warns(UserWarning, match=r"differs from the backed-up run \(epochs 3 -> 4\)"):
        make().fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=False)])
    # Other data is another run's: adopted only when asked, and reported.
    shutil.rmtree(backup_dir)
    shutil.copytree(crashed_once, backup_dir)
    with pytest.warns(UserWarning, match=r"differs from the backed-up run \(epochs 3 -> 4, num_samples 64 -> 56"):
        make().fit(X[:56], Y[:56], batch_size=8, epochs=4, verbose=0, callbacks=[
            BackupAndRestore(backup_dir, save_freq=2, adopt_other_runs=True)])


def test_state_file_records_position_and_seed(crashed_once):
    backup_dir = crashed_once
    path = os.path.join(backup_dir, store.backup_name(committed(backup_dir)[0]), "state.json")
    with open(path) as f:
        state = json.load(f)
    assert state["position"]["epoch"] == 1 and state["position"]["step"] == 2
    assert state["position"]["kind"] == "arrays"
    assert isinstance(state["data"]["seed"], int)
    names = [v[0] for v in state["variables"]["optimizer"]]
    assert names[0].endswith("/iteration") and names[1].endswith("/learning_rate")


# -- Keras' own usage ----------------------------------------------------------


class InterruptAt(keras.callbacks.Callback):
    """Raises in `hook` at `epoch` (a failure between two epochs)."""

    def __init__(self, hook, epoch):
        super().__init__()
        self.hook, self.epoch = hook, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if self.hook == "begin" and epoch == self.epoch:
            raise RuntimeError("Interrupting!")

    def on_epoch_end(self, epoch, logs=None):
        if self.hook == "end" and epoch == self.epoch:
            raise RuntimeError("Interrupting!")


def test_keras_docstring_example_resumes_with_the_same_callback(tmp_path):
    """keras.callbacks.BackupAndRestore's example, on a plain model."""
    callback = BackupAndRestore(backup_dir=str(tmp_path / "backup"))
    model = keras.models.Sequential([keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(), loss="mse")
    x, y = np.arange(100).reshape(5, 20), np.zeros(5)
    with pytest.raises(RuntimeError, match="Interrupting"):
        model.fit(x, y, epochs=10, batch_size=1, verbose=0,
                  callbacks=[callback, InterruptAt("begin", 4)])
    history = model.fit(x, y, epochs=10, batch_size=1, verbose=0, callbacks=[callback])
    assert len(history.history["loss"]) == 6


@pytest.mark.parametrize("distributed", [False, True])
def test_a_finished_epoch_is_never_repeated(tmp_path, distributed):
    """Another callback's on_epoch_end raises: the epoch was committed."""
    x, y = regression_data(n=32)
    model = mlp()
    if distributed:
        model = keras_dist.distribute(model, "mirrored")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interrupting"):
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False, callbacks=[
            BackupAndRestore(backup_dir), InterruptAt("end", 1)])
    assert int(model.optimizer.iterations.numpy()) == 8
    history = model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False,
                        callbacks=[BackupAndRestore(backup_dir)])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    assert int(model.optimizer.iterations.numpy()) == 16


@pytest.mark.parametrize("listed, named", [
    (["variables.index", "variables.data-00000-of-00002"], "variables.data-00001-of-00002"),
    (["variables.index"], "variables.data-*"),
    (["variables.data-00000-of-00001"], "variables.index"),
    (["variables.index", "variables.data-00000-of-00001", "variables.data-00000-of-00002"],
     "variables.data-*"),
])
def test_a_checkpoint_shard_missing_from_the_manifest_is_damage(tmp_path, listed, named):
    files = {name: {"bytes": 1, "sha256": ""} for name in listed}
    with pytest.raises(store.CorruptBackupError, match=re.escape(named)):
        store._check_shards(str(tmp_path), files)
    # Complete: index and every shard.
    store._check_shards(str(tmp_path), {name: {} for name in (
        "variables.index", "variables.data-00000-of-00002", "variables.data-00001-of-00002")})


def test_a_backup_directory_in_use_by_a_live_run_is_refused_and_left_intact(
        tmp_path, crashed_once):
    # Another run (another process) is training on the directory: it holds
    # the lock and is writing a backup. This run is refused before it reads
    # or removes anything; once the other process is gone (killed: no clean
    # up) its lock is gone with it and this run resumes exactly.
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    in_flight = os.path.join(backup_dir, ".tmp-backup-00000009-other")
    os.makedirs(in_flight)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other run's chief: takes the lock, then waits
        try:
            os.write(write, b"x" if store.lock(backup_dir) is None else b"-")
            time.sleep(300)
        finally:
            os._exit(0)
    try:
        assert os.read(read, 1) == b"x"
        before = sorted(os.listdir(backup_dir))
        assert store.LOCK in before and os.path.basename(in_flight) in before
        model = make()
        with pytest.raises(ValueError, match=re.escape(
                f"Received: backup_dir={backup_dir!r}, in use by pid {pid} on host ")):
            model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                      callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
        assert sorted(os.listdir(backup_dir)) == before
        assert int(model.optimizer.iterations.numpy()) == 0  # refused before a step
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        os.close(write)
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6
    assert not os.path.exists(backup_dir)  # deleted at the end, the lock too


def contents(directory):
    """Every file under `directory` with its bytes."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def test_another_runs_backups_are_refused_unless_adopted(tmp_path, crashed_once, capsys):
    # A finished or crashed run on other data left its backups (no lock):
    # a fit on other data refuses them before any step and touches nothing;
    # the run they belong to still resumes exactly afterwards.
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed_once, backup_dir)
    before = contents(backup_dir)
    x_other, y_other = regression_data(n=64, seed=5)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    for fit, trained_on in [
        (dict(x=x_other, y=y_other, batch_size=8),
         "arrays of the same shapes ((64, 6) float32, (64, 1) float32) with other values"),
        (dict(x=X[:48], y=Y[:48], batch_size=8),
         "arrays (64, 6) float32, (64, 1) float32 (this fit: arrays (48, 6) float32, "
         "(48, 1) float32)"),
        (dict(x=dataset), "arrays (64, 6) float32, (64, 1) float32 (this fit: dataset"),
    ]:
        model = make()
        with pytest.raises(ValueError, match=re.escape(
                f"belong to another run. Received: backup_dir={backup_dir!r}, whose "
                f"newest backup was written while training on {trained_on}")) as error:
            model.fit(**fit, epochs=EPOCHS, verbose=0,
                      callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
        assert "pass adopt_other_runs=True to BackupAndRestore" in str(error.value)
        assert int(model.optimizer.iterations.numpy()) == 0  # refused before a step
        assert contents(backup_dir) == before
    # Adopted when asked: the other data's fit resumes from the backup.
    capsys.readouterr()
    adopting = tmp_path / "adopting"
    shutil.copytree(crashed_once, adopting)
    model = make()
    history = model.fit(x_other, y_other, batch_size=8, shuffle=True, epochs=EPOCHS,
                        verbose=0, callbacks=[BackupAndRestore(
                            str(adopting), save_freq=2, adopt_other_runs=True)])
    assert "BackupAndRestore: restored" in capsys.readouterr().out
    assert len(history.history["loss"]) == EPOCHS - 1  # resumed in the second epoch
    # The run the backups belong to resumes to its uninterrupted weights.
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    assert max_abs_diff(reference_weights(), model.get_weights()) < 1e-6


def test_adopt_other_runs_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=re.escape(
            "Invalid type for argument `adopt_other_runs`. Expected a bool. "
            "Received: adopt_other_runs='yes'")):
        BackupAndRestore(str(tmp_path), adopt_other_runs="yes")


def test_one_process_reuses_the_directory_it_holds(tmp_path):
    # A fit that raised keeps or releases the lock, and the next fit in the
    # same process (a notebook, a retry) uses the directory again.
    backup_dir = str(tmp_path / "b")
    model = make()
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=2), Crash(at=5)])
    assert store.lock(backup_dir) is None
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    assert not os.path.exists(backup_dir)


def test_a_plain_keras_model_resumes_after_the_process_made_keras_global_seed(tmp_path):
    """The drop-in form (keras.Sequential, Keras' fit, keras_dist's callback,
    validation data): the backed-up run never drew from `keras.random`, the
    resumed process did before fit; it resumes, and every logged number
    (loss, val_loss) equals the uninterrupted run's."""
    backup_dir = str(tmp_path / "b")
    x = np.random.RandomState(0).rand(40, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    arguments = dict(x=x[:32], y=y[:32], batch_size=8, epochs=3, verbose=0, shuffle=False,
                     validation_data=(x[32:], y[32:]))

    def plain():  # keras.utils.set_random_seed: no global SeedGenerator
        return plain_model(seed=3, features=4, hidden=3, learning_rate=0.01)

    reference = plain()
    expected = reference.fit(**arguments).history
    with pytest.raises(RuntimeError, match="simulated crash"):
        plain().fit(**arguments, callbacks=[BackupAndRestore(backup_dir), Crash(6)])
    assert global_seed_state() is None  # the backup holds none
    model = plain()
    model.build((None, 4))
    keras.random.normal((2,))  # the resumed process's own unseeded draw
    before = global_seed_state()
    history = model.fit(**arguments, callbacks=[BackupAndRestore(backup_dir)])
    assert before is not None and global_seed_state() == before
    assert history.epoch == [1, 2]  # resumed after epoch 1's backup
    assert max_abs_diff(reference.get_weights(), model.get_weights()) < 1e-6
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history.history[key], expected[key][1:], rtol=1e-6)
