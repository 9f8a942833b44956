"""`BackupAndRestore`'s writes off the training thread.

A save copies the state to host memory at the step boundary (every worker:
under `MultiWorkerMirroredStrategy` reading a synchronized-on-read variable
is a collective, so every worker reads the same variables in the same
order), then one thread writes, seals and commits that copy while training
goes on. At most one write is in flight: the next save, the end of the fit
and a preemption wait for it first, and its error is raised there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf


@dataclass(frozen=True)
class Snapshot:
    """Host copies of a backup's variables, grouped as the backup groups them.

    `values` holds one array per distinct variable; `layout` lists, per group,
    the index into `values` of each of its variables (a variable that two
    groups list is read and written once, as `tf.train.Checkpoint` writes a
    shared object once).
    """

    values: list[np.ndarray]
    layout: dict[str, list[int]]

    @classmethod
    def of(cls, groups: dict[str, list], buffers: dict | None = None) -> Snapshot:
        """Copies the values of `groups` ({name: [variable, ...]}) to host memory.

        `buffers` ({}: kept by the caller between saves) holds the arrays
        of the previous snapshot, reused when its write is done: a fresh
        array costs a page fault per 4 KiB on its first write, several
        times the copy itself.
        """
        buffers = {} if buffers is None else buffers
        index: dict[int, int] = {}
        values: list[np.ndarray] = []
        layout: dict[str, list[int]] = {}
        for name, variables in groups.items():
            positions = []
            for variable in variables:
                if id(variable) not in index:
                    index[id(variable)] = len(values)
                    values.append(_copy(variable, buffers, len(values)))
                positions.append(index[id(variable)])
            layout[name] = positions
        return cls(values, layout)

    def write(self, prefix: str, host: dict | None = None) -> None:
        """Writes the checkpoint `tf.train.Checkpoint(**groups).write(prefix)`
        would have written at the snapshot's step (the same keys: it reads
        back into the live variables by their groups).

        Runs on the writing thread, where no distribution strategy's scope
        is open: the variables made here are plain host variables, kept in
        `host` ({}: by the caller, for the next write) and assigned anew.
        """
        host = {} if host is None else host
        variables = []
        with tf.device("/cpu:0"):
            for position, value in enumerate(self.values):
                variable = host.get(position)
                if variable is None or variable.shape != value.shape or (
                        variable.dtype.as_numpy_dtype != value.dtype):
                    variable = host[position] = tf.Variable(value, trainable=False)
                else:
                    variable.assign(value)
                variables.append(variable)
        tf.train.Checkpoint(**{
            name: [variables[i] for i in positions] for name, positions in self.layout.items()
        }).write(prefix)


def _copy(variable, buffers: dict, position: int) -> np.ndarray:
    """The variable's value in `buffers[position]` (made or remade when the
    shape or dtype differs)."""
    # A view of the value read (no copy yet), then one copy into the buffer.
    value = np.asarray(tf.convert_to_tensor(variable))
    buffer = buffers.get(position)
    if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
        buffer = buffers[position] = np.empty_like(value)
    np.copyto(buffer, value)
    return buffer


class BackgroundWrite:
    """One write at a time on a thread of its own.

    The thread is not a daemon: a process that ends normally (its main
    thread returns or raises) finishes the write in flight first. A killed
    process leaves it as a temporary directory that is never read.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Waits for the write in flight (raising its error), then starts `write`."""
        self.wait()

        def run():
            try:
                write()
            except BaseException as error:  # raised again by `wait`
                self._error = error

        self._thread = threading.Thread(target=run, name="keras_dist-backup-write")
        self._thread.start()

    def wait(self) -> None:
        """Returns once no write is in flight; raises the error of the last
        one, if it failed (once)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


_WRITERS: dict[str, BackgroundWrite] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(directory: str) -> BackgroundWrite:
    """The one writer of this process for `directory`: every callback on the
    same `backup_dir` (a new one per fit, say) waits for the write another
    left in flight before it reads or cleans the directory."""
    key = os.path.realpath(directory)
    with _WRITERS_LOCK:
        return _WRITERS.setdefault(key, BackgroundWrite())
