"""Storage faults never lose a backup already saved, and never crash a restore.

In one process (4 logical-CPU replicas), with the models of
tests/callbacks/test_backup_and_restore.py.
"""

import contextlib
import errno
import os
import shutil
import subprocess

import keras
import pytest

from callbacks.test_backup_and_restore import (
    EPOCHS,
    crash,
    fit_args,
    make,
    reference_weights,
)
from helpers import max_abs_diff
from keras_dist import _backup_store as store
from keras_dist.callbacks import BackupAndRestore


def resumed_weights(backup_dir):
    model = make()
    model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, save_freq=2)])
    return model.get_weights()


@contextlib.contextmanager
def small_filesystem(path, size="4m"):
    """A tmpfs mounted at `path` (root only; skipped elsewhere)."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class FillDisk(keras.callbacks.Callback):
    """Fills the filesystem after `at` steps (the next backup cannot fit)."""

    def __init__(self, path, at, backup=None):
        super().__init__()
        self.path, self.at, self.done, self.backup = path, at, False, backup

    def on_train_batch_end(self, batch, logs=None):
        if self.done or self.model.optimizer.iterations.numpy() < self.at:
            return
        self.done = True
        if self.backup is not None:  # the backup being written lands first
            self.backup.wait_until_finished()
        with open(os.path.join(self.path, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError as error:
                assert error.errno == errno.ENOSPC


def test_a_full_disk_keeps_the_saved_backups_and_resumes_exactly(tmp_path):
    with small_filesystem(tmp_path / "disk") as disk:
        backup_dir = str(disk / "b")
        model = make()
        with pytest.raises(RuntimeError, match=(
                r"writing backup \d+ to .* failed .*No space left on device.*"
                r"already saved are intact \(newest: backup-\d+\)")):
            backup = BackupAndRestore(backup_dir, save_freq=2)
            model.fit(**fit_args("numpy"), epochs=EPOCHS, verbose=0, callbacks=[
                backup, FillDisk(disk, at=11, backup=backup)])
        kept = store.list_backups(backup_dir)
        assert kept and kept[0] == 5  # steps 2, 4, ..., 10
        for sequence in kept:
            store.verify(os.path.join(backup_dir, store.backup_name(sequence)))
        assert not [n for n in os.listdir(backup_dir) if n.startswith(store.TMP_PREFIX)]
        os.remove(disk / "filler")
        assert max_abs_diff(reference_weights(), resumed_weights(backup_dir)) < 1e-6


def test_a_file_in_place_of_the_backup_dir_is_refused_first(tmp_path):
    path = tmp_path / "b"
    path.write_text("not a directory")
    model = make()
    with pytest.raises(ValueError, match=r"`backup_dir`: it must be a writable directory"):
        model.fit(**fit_args("numpy"), epochs=1, verbose=0,
                  callbacks=[BackupAndRestore(str(path))])
    assert model.optimizer.iterations.numpy() == 0
    assert path.read_text() == "not a directory"


def test_a_read_only_backup_dir_is_refused_first(tmp_path):
    with small_filesystem(tmp_path / "ro", size="1m") as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        model = make()
        with pytest.raises(ValueError, match=r"writable directory.*Read-only file system"):
            model.fit(**fit_args("numpy"), epochs=1, verbose=0,
                      callbacks=[BackupAndRestore(str(disk / "b"))])
        assert model.optimizer.iterations.numpy() == 0


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    backup_dir = str(tmp_path_factory.mktemp("crashed") / "b")
    crash(backup_dir, "numpy", at=11)
    return backup_dir


def delete_file(path):
    os.remove(path)


def dangling_latest(path):
    with open(path, "w") as f:
        f.write("backup-00000099\n")


@pytest.mark.parametrize("target,damage,falls_back", [
    ("variables.index", delete_file, True),
    ("state.json", delete_file, True),
    ("MANIFEST.json", delete_file, True),
    ("../latest", dangling_latest, False),  # not used to choose: harmless
])
def test_deleted_files_and_a_dangling_pointer(tmp_path, crashed, target, damage, falls_back):
    backup_dir = str(tmp_path / "b")
    shutil.copytree(crashed, backup_dir)
    newest = store.list_backups(backup_dir)[0]
    damage(os.path.normpath(os.path.join(backup_dir, store.backup_name(newest), target)))
    if falls_back:
        with pytest.warns(UserWarning, match="skipping damaged backup"):
            weights = resumed_weights(backup_dir)
    else:
        weights = resumed_weights(backup_dir)
    assert max_abs_diff(reference_weights(), weights) < 1e-6
