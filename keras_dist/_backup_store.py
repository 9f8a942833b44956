"""Atomic, verified backup directories for `BackupAndRestore`.

Layout of `backup_dir` (only the chief's copy persists)::

    backup-00000007/          one committed backup
        variables.index       tf.train.Checkpoint of every variable
        variables.data-*
        state.json            epoch, step, data position, callback states
        arrays.npz            large callback state (EarlyStopping weights)
        MANIFEST.json         size and sha256 of every file above
    latest                    name of the newest committed backup
    .tmp-backup-00000008-*/   a backup being written (never read)
    .lock                     held by the chief of the run that uses it

A backup is written under a temporary name, every file is fsynced, the
directory is renamed into place, then `latest` is replaced atomically. Older
backups are pruned only after a newer one is committed. On restore the
newest backup whose manifest verifies is used; a damaged one is reported by
file and skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import time

import numpy as np

FORMAT = 1  # of state.json
MANIFEST = "MANIFEST.json"
STATE = "state.json"
POINTER = "latest"
LOCK = ".lock"
PREFIX = "backup-"
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^backup-(\d{8})$")


class CorruptBackupError(Exception):
    """A backup that fails verification; `path` names the bad file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def backup_name(sequence: int) -> str:
    return f"{PREFIX}{sequence:08d}"


def sequence_of(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def list_backups(backup_dir: str) -> list[int]:
    """Sequence numbers of committed backups, newest first."""
    if not os.path.isdir(backup_dir):
        return []
    found = [sequence_of(n) for n in os.listdir(backup_dir)]
    return sorted((s for s in found if s is not None), reverse=True)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, payload) -> None:
    """Writes JSON to `path` through a temporary file, fsync and rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def seal(directory: str) -> dict:
    """fsyncs every file of `directory` and writes its manifest."""
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == MANIFEST or not os.path.isfile(path):
            continue
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        files[name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"format": 1, "files": files}
    write_json(os.path.join(directory, MANIFEST), manifest)
    fsync_dir(directory)
    return manifest


def commit(tmp_dir: str, backup_dir: str, sequence: int) -> str:
    """Renames a sealed backup into place, then points `latest` at it."""
    final = os.path.join(backup_dir, backup_name(sequence))
    if os.path.exists(final):  # a stale copy from a run that crashed later
        shutil.rmtree(final)
    os.rename(tmp_dir, final)
    fsync_dir(backup_dir)
    tmp_pointer = os.path.join(backup_dir, f"{POINTER}.tmp-{os.getpid()}")
    with open(tmp_pointer, "w") as f:
        f.write(backup_name(sequence) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_pointer, os.path.join(backup_dir, POINTER))
    fsync_dir(backup_dir)
    return final


def prune(backup_dir: str, keep: int) -> None:
    """Deletes all but the newest `keep` committed backups."""
    for sequence in list_backups(backup_dir)[keep:]:
        shutil.rmtree(os.path.join(backup_dir, backup_name(sequence)), ignore_errors=True)


def remove_stale_tmp(backup_dir: str) -> None:
    """Removes half-written backups left by a process that died saving."""
    if not os.path.isdir(backup_dir):
        return
    for name in os.listdir(backup_dir):
        if name.startswith(TMP_PREFIX) or name.startswith(f"{POINTER}.tmp-"):
            path = os.path.join(backup_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def verify(directory: str, data_read_checked: bool = False) -> dict:
    """Checks a backup against its manifest and returns its parsed state.

    `data_read_checked`: the caller reads the variables with
    `read_checked_variables`, which checks the checkpoint's one data shard
    as it reads it, before any variable changes; the shard's bytes are then
    not hashed here (its size still is). That read is what a restore does
    anyway, so the restore does not read and hash 57 MB an extra time.

    Raises:
        CorruptBackupError: naming the first missing, truncated, altered or
            unparsable file.
    """
    files = _read_manifest(directory)
    skip = set()
    if data_read_checked:
        shards = [name for name in files if name.startswith("variables.data-")]
        if shards == ["variables.data-00000-of-00001"]:
            skip = set(shards)
    _check_files(directory, files, unhashed=skip)
    array_names = _array_names(os.path.join(directory, "arrays.npz"))
    state_path = os.path.join(directory, STATE)
    state = _read_state(state_path)
    if state.get("format") == FORMAT:  # another format is refused by its reader
        problem = _state_problem(state, array_names)
        if problem:
            raise CorruptBackupError(state_path, problem)
        _check_shards(directory, files)
        _check_checkpoint(os.path.join(directory, "variables"))
    return state


def _check_shards(directory: str, files: dict) -> None:
    """The manifest lists the checkpoint's index and each of its data shards
    (`variables.data-K-of-N`, K < N): a shard missing from disk and from
    the manifest would pass the file checks and fail the restore."""
    index = os.path.join(directory, "variables.index")
    if "variables.index" not in files:
        raise CorruptBackupError(index, "missing from the manifest")
    shards = [name for name in files if name.startswith("variables.data-")]
    counts = {name.rsplit("-of-", 1)[-1] for name in shards}
    expected = (
        {f"variables.data-{k:05d}-of-{n}" for n in counts for k in range(int(n))}
        if len(counts) == 1 and all(n.isdigit() for n in counts) else set()
    )
    missing = sorted(expected - set(shards))
    if not shards or len(counts) != 1 or missing or set(shards) != expected:
        name = missing[0] if missing else "variables.data-*"
        raise CorruptBackupError(
            os.path.join(directory, name), "data shard missing from the manifest and the disk"
        )


def _read_manifest(directory: str) -> dict:
    """The manifest's file list: name -> {"bytes", "sha256"}."""
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict) or STATE not in files:
            raise ValueError("no file list")
        for name, expected in files.items():
            if os.path.basename(name) != name or name.startswith(".") or not (
                isinstance(expected, dict)
                and type(expected.get("bytes")) is int
                and isinstance(expected.get("sha256"), str)
            ):
                raise ValueError(f"malformed entry {name!r}: {expected!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptBackupError(manifest_path, f"unreadable manifest ({error})") from None
    return files


def _check_files(directory: str, files: dict, unhashed=frozenset()) -> None:
    """Every file on disk is listed, and every listed file is intact (the
    ones named in `unhashed`: of the listed size)."""
    try:
        on_disk = {
            name for name in os.listdir(directory)
            if name != MANIFEST and os.path.isfile(os.path.join(directory, name))
        }
    except OSError as error:
        raise CorruptBackupError(
            os.path.join(directory, MANIFEST), f"unreadable manifest ({error})"
        ) from None
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        raise CorruptBackupError(
            os.path.join(directory, unlisted[0]), "not in the manifest (edited backup?)"
        )
    for name, expected in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CorruptBackupError(path, "missing")
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            raise CorruptBackupError(
                path, f"{size} bytes, expected {expected['bytes']} (truncated?)"
            )
        if name in unhashed:
            continue
        try:
            digest = _sha256(path)
        except OSError as error:
            raise CorruptBackupError(path, f"unreadable ({error})") from None
        if digest != expected["sha256"]:
            raise CorruptBackupError(path, "checksum mismatch (corrupted)")


def _array_names(arrays_path: str) -> set[str]:
    """The arrays in `arrays.npz` (each read once), or none without the file."""
    if not os.path.isfile(arrays_path):
        return set()
    try:  # plain arrays only: never unpickles
        with np.load(arrays_path, allow_pickle=False) as arrays:
            for key in arrays.files:
                arrays[key]
            return set(arrays.files)
    except (OSError, ValueError) as error:
        raise CorruptBackupError(arrays_path, f"unreadable arrays ({error})") from None


def _read_state(state_path: str) -> dict:
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, ValueError) as error:
        raise CorruptBackupError(state_path, f"invalid JSON ({error})") from None
    if not isinstance(state, dict):
        raise CorruptBackupError(state_path, f"not a JSON object ({type(state).__name__})")
    return state


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _state_problem(state: dict, array_names: set[str]) -> str | None:
    """What is malformed in a format-1 state, or None (one check per section)."""
    for check in (_position_problem, _data_problem, _variables_problem):
        problem = check(state)
        if problem:
            return problem
    return _callbacks_problem(state, array_names)


def _position_problem(state: dict) -> str | None:
    position = state.get("position")
    if not isinstance(position, dict):
        return "no position"
    for key in ("epoch", "step", "created", "consumed"):
        if not _is_count(position.get(key)):
            return f"position {key!r} is {position.get(key)!r}, not a count"
    if not isinstance(position.get("persistent", False), bool):
        return f"position 'persistent' is {position.get('persistent')!r}"
    return None


def _data_problem(state: dict) -> str | None:
    data = state.get("data", {})
    if not isinstance(data, dict) or not (
        data.get("seed") is None or type(data.get("seed")) is int
    ):
        return f"malformed data position {data!r}"
    for key in ("fit", "callbacks"):
        if not isinstance(state.get(key, {}), dict):
            return f"{key!r} is not an object"
    return None


def _is_variable_description(d) -> bool:
    """[path, shape, dtype]."""
    return (
        isinstance(d, list)
        and len(d) == 3
        and isinstance(d[0], str)
        and isinstance(d[1], list)
        and all(type(n) is int for n in d[1])
        and isinstance(d[2], str)
    )


def _variables_problem(state: dict) -> str | None:
    variables = state.get("variables")
    if not isinstance(variables, dict):
        return "no variable list"
    for group in ("model", "optimizer"):
        described = variables.get(group)
        if not isinstance(described, list) or not all(
            _is_variable_description(d) for d in described
        ):
            return f"malformed variable list {group!r}"
    return None


def _callbacks_problem(state: dict, array_names: set[str]) -> str | None:
    """Malformed callback states, or `best_weights` arrays they name but lack."""
    needed = []
    for key, values in state.get("callbacks", {}).items():
        if not isinstance(values, dict):
            return f"callback state {key!r} is not an object"
        count = values.get("best_weights")
        if count is not None:
            if not _is_count(count):
                return f"callback state {key!r}: best_weights is {count!r}"
            needed += [f"{key}/best_weights/{i}" for i in range(count)]
    missing = sorted(set(needed) - array_names)
    if missing:
        return f"arrays.npz lacks {missing[0]!r}" if array_names else "arrays.npz is missing"
    return None


def _check_checkpoint(prefix: str) -> None:
    """The variables checkpoint opens (its index parses)."""
    import tensorflow as tf

    try:
        tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CorruptBackupError(
            prefix + ".index", f"unreadable checkpoint ({type(error).__name__}: {message})"
        ) from None


def read_checked_variables(directory: str, checkpoint) -> None:
    """Reads `checkpoint` (a `tf.train.Checkpoint`) from a verified backup.

    TensorFlow checks every tensor of a data shard against the CRC32C its
    index records (the index itself is covered by the manifest's sha256)
    while it reads the shard, and fails before it assigns any variable: a
    damaged shard leaves the variables as they were.

    Raises:
        CorruptBackupError: the data shard does not match its checksums.
    """
    import tensorflow as tf

    try:
        checkpoint.read(os.path.join(directory, "variables")).expect_partial()
    except tf.errors.OpError as error:
        # DataLossError when read eagerly; a plain OpError of that code or
        # message from inside the restore's function.
        if error.error_code != tf.errors.DATA_LOSS and "Checksum does not match" not in str(error):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CorruptBackupError(
            os.path.join(directory, "variables.data-00000-of-00001"),
            f"checksum mismatch (corrupted): {message[-160:]}",
        ) from None


# This process's held locks: real path of the backup directory -> open file
# descriptor. A later fit in the same process (a notebook, a retry after an
# exception) keeps using the directory it holds.
_HELD: dict[str, int] = {}


def lock(backup_dir: str) -> str | None:
    """Takes `backup_dir`'s lock for this process; None when taken, else a
    description of the live holder (another run uses the directory).

    An advisory lock (`flock`) on `backup_dir/.lock`: released by the
    operating system when its holder exits, so a run that was killed never
    leaves a stale lock. Where there are no advisory locks (Windows) the
    directory is not locked.
    """
    try:
        import fcntl
    except ImportError:
        return None
    real = os.path.realpath(backup_dir)
    if real in _HELD:
        return None
    path = os.path.join(real, LOCK)
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # cannot be created (no inode left): unlocked, as on Windows
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.read(fd, 4096).decode("utf-8", "replace")
            os.close(fd)
            try:
                info = json.loads(holder)
                return (f"pid {info['pid']} on host {info['host']}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['since']))}")
            except (ValueError, KeyError, TypeError):
                return "a process that holds its lock"
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            same = False
        if not same:  # removed (delete_all) while this process waited: again
            os.close(fd)
            continue
        with contextlib.suppress(OSError):  # who holds it (a full disk: held unnamed)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "since": time.time()}).encode())
        _HELD[real] = fd
        return None
    return "a process that removes and creates its lock repeatedly"


def unlock(backup_dir: str) -> None:
    """Releases this process's lock on `backup_dir`, if it holds it: its
    file is removed first (a process waiting on it finds it gone and takes
    a new one), then the directory if empty."""
    real = os.path.realpath(backup_dir)
    fd = _HELD.pop(real, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.remove(os.path.join(real, LOCK))
    os.close(fd)  # releases the lock
    with contextlib.suppress(OSError):
        os.rmdir(real)


def delete_all(backup_dir: str) -> None:
    """Removes every file this module wrote, then the directory if empty."""
    if not os.path.isdir(backup_dir):
        return
    for sequence in list_backups(backup_dir):
        shutil.rmtree(os.path.join(backup_dir, backup_name(sequence)), ignore_errors=True)
    remove_stale_tmp(backup_dir)
    pointer = os.path.join(backup_dir, POINTER)
    if os.path.exists(pointer):
        os.remove(pointer)
    # Left in place when the user keeps other files there.
    with contextlib.suppress(OSError):
        os.rmdir(backup_dir)
