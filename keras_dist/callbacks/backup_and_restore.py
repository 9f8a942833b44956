"""`BackupAndRestore`: exact, atomic, multi-worker-safe training backups."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Literal

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _backup_store as store
from keras_dist import (
    _checks,
    _collectives,
    _data,
    _exit_codes,
    _fit_session,
    _keras_compat,
    _liveness,
    _resume,
)
from keras_dist.callbacks import _background_write, _preemption, _save_requests
from keras_dist.callbacks import _callback_states as callback_states
from keras_dist.callbacks._sibling_hooks import SiblingHooks

PREEMPTED_EXIT_CODE = _exit_codes.PREEMPTED
"""Exit status of a process that saved a backup on a preemption signal."""

_FORMAT = store.FORMAT
# How keras_dist's shuffled array input orders a pass (`_data.shuffled_indices`).
_ORDER = "stateless-by-pass"
# What the chief tells every worker instead of a backup number.
_IN_USE = -1  # another live run holds the directory's lock
_OTHER_RUN = -2  # the newest backup is another run's (other training data)

class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training so that a killed or preempted job resumes exactly.

    A drop-in for `keras.callbacks.BackupAndRestore` (same positional
    arguments). A backup holds the model, optimizer and metric variables,
    Keras' random seed states, the epoch and step, the input's position and
    the state of the other stateful callbacks of the same `fit`
    (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`, and any
    callback with `get_state()`/`set_state()`). A restarted `fit` with the
    same arguments continues at the step after the last backup, on the same
    data: with `DistributedModel` (or `keras_dist.distribute(model)`), numpy
    inputs with `shuffle=True` and seeded `tf.data` pipelines resume with the
    weights an uninterrupted run would reach.

    Backups are atomic (written under a temporary name, fsynced, renamed,
    then pointed to by `latest`) and verified: each records the size and
    sha256 of its files (the checkpoint's data is also checked against its
    CRC32Cs as it is read), and a damaged backup is skipped, with a warning
    naming the bad file, in favour of the previous one. Under
    `MultiWorkerMirroredStrategy` every worker takes part in each save, only
    the chief's files persist, and all workers restore the same backup.

    Training waits only while a save copies the state to host memory: the
    files are written, sealed and committed on a background thread while
    the next steps run. One write is in flight at a time (the next save
    waits for it); the end of `fit` and a preemption wait for it, and a
    failed write raises at the next of those. A process killed during a
    write resumes from the backup before it. `wait_until_finished()` waits
    for the write in flight.

    On a preemption signal (SIGTERM by default) every worker saves at the
    same step boundary (under multi-worker training the one after the
    signal's: the workers agree through the job's key-value store, not
    with a collective per step) and exits with status `PREEMPTED_EXIT_CODE`
    (42), for `keras-dist launch --max-restarts` or a scheduler's requeue to
    resume. A second signal of the same kind is handled as if the callback
    were absent.

    Args:
        backup_dir: String, path of the directory that holds the backups.
            Created if missing. Use a directory no other run writes to.
        save_freq: `"epoch"` (default) to back up after each epoch, or a
            positive integer to back up every that many batches (rounded up
            to a whole `steps_per_execution`).
        double_checkpoint: Boolean, kept for parity with Keras: keep the
            previous backup as a fallback. Always the case here unless
            `max_to_keep=1`, which it then rejects.
        delete_checkpoint: Boolean, default True: delete the backups when
            training ends normally (the chief deletes them).
        max_to_keep: Positive integer, default 2: how many committed backups
            to keep. A backup is deleted only after a newer one is committed.
        save_every_seconds: Optional positive number: also back up once
            this many seconds passed since the last backup (the chief's
            clock; every worker saves at the same step).
        preemption_signals: A signal, or a sequence of signals, that
            triggers a save-and-exit at a step boundary, default
            `(signal.SIGTERM,)`. `None` or `()` disables it. Handlers are installed from the main thread only.
        adopt_other_runs: Boolean, default False. A backup records what
            its run trained on (the arrays' shapes and a digest of their
            values; a dataset's element spec and cardinality); a fit on
            other data refuses to resume from it, before any step and
            without touching the directory. True resumes from it anyway.
            (A `keras_dist` model's `fit` sees its data; under a plain
            `keras.Model.fit` there is nothing to compare.)

    Example:

        >>> import tempfile
        >>> import numpy as np
        >>> import keras
        >>> import keras_dist
        >>> from keras_dist.callbacks import BackupAndRestore
        >>> model = keras_dist.distribute(
        ...     keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        ...     strategy="default")
        >>> model.compile("sgd", "mse")
        >>> backup = BackupAndRestore(tempfile.mkdtemp(), save_freq=2)
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2,
        ...                     epochs=2, callbacks=[backup], verbose=0)
        >>> len(history.history["loss"])
        2

    Raises:
        ValueError: for an invalid argument value (in the constructor); for
            a `backup_dir` that is not a writable directory, or a backup
            whose variables do not match the model (in `on_train_begin`,
            before any training step).
        TypeError: for an argument of the wrong type.
    """

    PREEMPTED_EXIT_CODE = PREEMPTED_EXIT_CODE

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: Literal["epoch"] | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        max_to_keep: int = 2,
        save_every_seconds: float | None = None,
        preemption_signals: int | Sequence[int] | None = (signal.SIGTERM,),
        adopt_other_runs: bool = False,
    ):
        super().__init__()
        _check_backup_dir(backup_dir)
        if save_freq != "epoch" and not _checks.is_positive_int(save_freq):
            raise ValueError(
                "Invalid value for argument `save_freq`. Expected \"epoch\" or "
                f"a positive integer. Received: save_freq={save_freq!r}"
            )
        for name, value in (
            ("double_checkpoint", double_checkpoint),
            ("delete_checkpoint", delete_checkpoint),
            ("adopt_other_runs", adopt_other_runs),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"Invalid type for argument `{name}`. Expected a bool. "
                    f"Received: {name}={value!r}"
                )
        _check_keep(max_to_keep, double_checkpoint)
        if save_every_seconds is not None and not _checks.is_positive_number(save_every_seconds):
            raise ValueError(
                "Invalid value for argument `save_every_seconds`. Expected None "
                f"or a positive, finite number of seconds. Received: "
                f"save_every_seconds={save_every_seconds!r}"
            )
        # Configuration: survives across fit() calls.
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = int(max_to_keep)
        self.save_every_seconds = save_every_seconds
        self.preemption_signals = _preemption.checked_signals(preemption_signals)
        self.adopt_other_runs = adopt_other_runs
        self._selected = None  # chosen backup, from selection to end of fit
        self._session = None  # the DistributedModel.fit session, during one
        self._skipping = _fit_session.TrainFunctionOverride()
        self._siblings = SiblingHooks()
        self._signals = _preemption.PreemptionSignals()
        self._writes = _background_write.writer_for(self.backup_dir)
        self._buffers = {}  # host memory of the last snapshot, reused by the next
        self._host = {}  # the writing thread's host variables, reused likewise
        self._reset_run()

    # -- per-run state (reset at the start and end of every fit) -----------

    def _reset_run(self) -> None:
        self._strategy = None
        self._chief = True
        self._multi_worker = False
        self._context = None
        self._cursor = None
        self._sequence = 0
        self._epoch = 0
        self._step = 0  # batches done in the current epoch
        self._begin = 0
        self._since_save = 0
        self._last_save_time = time.monotonic()
        self._pending_epoch_save = False
        self._saved_states = ({}, {})  # other callbacks' states at the epoch save
        self._pending_plan = None  # the restored backup's plan, until its epoch begins
        self._skip_calls = 0
        self._skip_extra = 0
        self._skipped_last_call = False
        self._warned = set()
        self._pending = None  # a save due at this batch: (preempted,)
        self._damaged = set()  # backups whose data failed as they were read
        self._requests = None  # save requests agreed through the job's store
        self._calls = 0  # batch-end calls handled in this fit
        self._asked = set()  # what this worker requested since its last save

    def _undo(self) -> None:
        """Undoes what this callback set up for a fit (hooks, handlers, the
        train-function override)."""
        self._siblings.remove()
        self._signals.restore()
        self._skipping.remove()
        if self._requests is not None:
            self._requests.close(end_watchers=False)

    # -- selection and restore ---------------------------------------------

    def _check_dir(self) -> None:
        path = self.backup_dir
        try:
            if self._chief:
                os.makedirs(path, exist_ok=True)
                probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-")
                probe.close()
            elif os.path.exists(path) and not os.path.isdir(path):
                raise NotADirectoryError(path)
        except OSError as error:
            raise ValueError(
                "Invalid value for argument `backup_dir`: it must be a "
                f"writable directory. Received: backup_dir={path!r} "
                f"({type(error).__name__}: {error.strerror or error}). Pass a "
                "directory path this process can create and write."
            ) from None

    def setup_fit(self, session) -> None:
        """The fit-session hook (see `keras_dist/_fit_session.py`).

        The backup is chosen now, before `fit` shuffles its input: the
        shuffle seed of the interrupted run is part of the backup.
        """
        session.claim("backup", self)
        self._settle()  # an earlier fit's last write, before choosing
        self._session = session
        session.add_teardown(self._release)
        state = self._select(session.strategy, fresh=True)
        if state is not None:
            session.resume = self._plan(self._selected[0], state, session.model)

    def _select(self, strategy, fresh: bool = False):
        """Chooses (once per fit) the backup to restore; None when none.

        `fresh` drops a choice left by an earlier fit that never reached
        `on_train_end` (it raised): a new fit looks at the disk again.
        """
        self._strategy = strategy
        info = _collectives.process_info(strategy)
        self._chief = info.is_chief
        self._multi_worker = _collectives.is_multi_worker(strategy)
        if fresh:
            self._selected = None
        if self._selected is not None:
            return self._selected[1]
        self._check_dir()
        # One run per backup directory: the chief holds its lock until the
        # fit ends. Another live run's directory is refused on every worker
        # (the chief's answer travels with its choice), before anything in
        # it is read or removed.
        holder = store.lock(self.backup_dir) if self._chief else None
        chosen, state = (0, None) if holder or not self._chief else self._newest_intact()
        other_run = self._other_run(state) if state is not None else None
        code = _IN_USE if holder else _OTHER_RUN if other_run else chosen
        chosen = _collectives.agree_sum(strategy, [code])[0]
        if chosen == _OTHER_RUN:
            trained_on = other_run or "other data (the chief worker's error names it)"
            raise ValueError(
                "BackupAndRestore: the backups in `backup_dir` belong to another "
                f"run. Received: backup_dir={self.backup_dir!r}, whose newest backup "
                f"was written while training on {trained_on}. "
                "Resuming would carry that run's weights and position into this "
                "one. Give this run its own backup_dir, delete those backups if "
                "that run is over, or pass adopt_other_runs=True to "
                "BackupAndRestore to resume from them anyway."
            )
        if chosen < 0:
            raise ValueError(
                "Invalid value for argument `backup_dir`: another run is using "
                f"it. Received: backup_dir={self.backup_dir!r}, in use by "
                f"{holder or 'a run the chief worker named (see its output)'}. Two "
                "runs writing one backup directory overwrite each other's "
                "backups: give this run its own backup_dir, or stop the other "
                "run first (its lock is released when it exits)."
            )
        if chosen and state is None:  # the chief verified its choice above
            directory = os.path.join(self.backup_dir, store.backup_name(chosen))
            try:
                state = store.verify(directory, data_read_checked=True)
            except store.CorruptBackupError as error:
                raise ValueError(
                    f"BackupAndRestore: worker {info.rank} cannot read the "
                    f"backup the chief chose ({error}). Give every worker the "
                    "same (shared) `backup_dir`."
                ) from None
        # Later saves continue the numbering past every backup on disk.
        existing = store.list_backups(self.backup_dir) if self._chief else []
        newest = _collectives.agree_sum(strategy, [existing[0] if existing else 0])[0]
        self._selected = (chosen, state, newest)
        return state

    def _newest_intact(self) -> tuple[int, dict | None]:
        """The chief's choice: the newest backup that verifies."""
        store.remove_stale_tmp(self.backup_dir)
        for sequence in store.list_backups(self.backup_dir):
            if sequence in self._damaged:
                continue
            directory = os.path.join(self.backup_dir, store.backup_name(sequence))
            try:
                # The data shard is checked as the restore reads it.
                return sequence, store.verify(directory, data_read_checked=True)
            except store.CorruptBackupError as error:
                warnings.warn(
                    f"BackupAndRestore: skipping damaged backup {directory}: "
                    f"{error.path}: {error.reason}. Trying the previous one.",
                    stacklevel=3,
                )
        return 0, None

    def _other_run(self, state: dict) -> str | None:
        """What the backup's run trained on, when it is not this fit's data
        (and adopting other runs was not asked for); else None."""
        if self.adopt_other_runs or self._session is None:
            return None
        saved = state.get("data", {}).get("fingerprint")
        current = self._session.data_fingerprint()
        if saved is None or current is None or saved == current:
            return None
        if saved["shapes"] == current["shapes"]:
            return f"{saved['kind']} of the same shapes ({saved['shapes']}) with other values"
        return f"{saved['kind']} {saved['shapes']} (this fit: {current['kind']} {current['shapes']})"

    def _settle(self) -> None:
        """Waits for a write that a fit which raised left in flight (its
        error, if any, as a warning: the fit's own error came first)."""
        try:
            self._writes.wait()
        except RuntimeError as error:
            warnings.warn(str(error), stacklevel=3)

    def _release(self) -> None:
        """Undoes what a fit that did not reach `on_train_end` left behind."""
        self._settle()  # the backup in flight, before the lock goes
        self._buffers.clear()
        self._host.clear()
        store.unlock(self.backup_dir)
        self._undo()
        self._selected = None
        self._session = None

    def _groups(self) -> dict:
        return backup_groups(self.model)

    def _plan(self, chosen: int, state: dict, model) -> _resume.ResumePlan:
        if state.get("format") != _FORMAT:
            raise ValueError(
                f"BackupAndRestore: backup {chosen} in {self.backup_dir!r} "
                f"has format {state.get('format')!r}; this version reads "
                f"format {_FORMAT}."
            )
        directory = os.path.join(self.backup_dir, store.backup_name(chosen))
        spe = max(1, int(model.steps_per_execution or 1))
        return _resume.ResumePlan.from_backup(state, directory, spe)

    def _restore(self, plan: _resume.ResumePlan) -> None:
        state, directory = plan.state, plan.directory
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore: the model has no variables to restore the "
                f"backup in {self.backup_dir!r} into: Keras builds this model "
                "at its first training step, after the backup must be "
                "restored. Build it before fit (call it on one batch of "
                "inputs, or model.build(input_shape)), or wrap it with "
                "keras_dist.distribute(model), which builds it first."
            )
        groups = backup_groups(self.model, saved=state["variables"])
        _resume.check_compatible(state["variables"], groups, self.backup_dir)
        checkpoint = tf.train.Checkpoint(
            model=groups["model"], optimizer=groups["optimizer"]
        )
        try:
            store.read_checked_variables(directory, checkpoint)
            damage = None
        except store.CorruptBackupError as error:
            damage = error
        if self._multi_worker:
            failed = _collectives.agree_any(self._strategy, [damage is not None])[0]
        else:
            failed = damage is not None
        if failed:
            self._fall_back(directory, damage)
            return
        if hasattr(self.model, "__keras_dist_restore_backup_variables__"):
            self.model.__keras_dist_restore_backup_variables__()  # onto the mesh's shards
        changed = _resume.changed_arguments(state.get("fit", {}), self._fit_arguments())
        if changed:
            self._warn_once("changes", changed)
        self._pending_plan = plan
        # Keras' loop reads the start epoch after on_train_begin.
        _keras_compat.set_initial_epoch(self.model, plan.epoch)
        self._skip_calls, self._skip_extra = plan.skip_calls, plan.skip_extra
        mid_execution = plan.restarts_mid_execution()
        if mid_execution:
            self._warn_once("spe", mid_execution)
        if self._skip_calls or self._skip_extra:
            self._wrap_train_function()
        if self._chief:
            print(
                f"BackupAndRestore: restored {directory} (epoch {plan.epoch + 1}, "
                f"step {plan.step})",
                flush=True,
            )

    def _fall_back(self, directory: str, damage) -> None:
        """The chosen backup's data failed its checksums as it was read (on
        this worker: `damage`, or on another): the previous intact one is
        restored instead, as for any damaged backup."""
        where = f"{damage.path}: {damage.reason}" if damage else "damaged on another worker"
        warnings.warn(
            f"BackupAndRestore: skipping damaged backup {directory}: {where}. "
            "Trying the previous one.",
            stacklevel=3,
        )
        self._damaged.add(self._selected[0])
        state = self._select(self._strategy, fresh=True)
        if state is None:
            raise ValueError(
                f"BackupAndRestore: the backup in {directory} is damaged and "
                f"`backup_dir` ({self.backup_dir!r}) holds no intact one "
                "before it; some variables may have been read from it. "
                "Nothing was deleted: move the damaged backup out of "
                "`backup_dir` to start this run from its beginning."
            )
        plan = self._plan(self._selected[0], state, self.model)
        shuffled = getattr(getattr(self._context, "resume", None), "seed", None)
        if shuffled is not None and plan.seed != shuffled:
            self._warn_once(
                "seed",
                "BackupAndRestore: the previous backup was written by a run "
                "that shuffled with another seed; the resumed epoch may see "
                "a different order.",
            )
        self._restore(plan)

    def _steps_per_execution(self) -> int:
        return max(1, int(self.model.steps_per_execution or 1))

    def _fit_arguments(self) -> dict:
        context = self._context
        return {
            "epochs": self.params.get("epochs"),
            "steps_per_epoch": self.params.get("steps"),
            "num_samples": getattr(context, "num_samples", None),
            "batch_size": getattr(context, "batch_size", None),
            "steps_per_execution": self._steps_per_execution(),
        }

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self._chief:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # -- skipping the batches already trained ------------------------------

    def _wrap_train_function(self) -> None:
        spe = self._steps_per_execution()

        def consume(iterator, count):
            for _ in range(count):
                next(iterator)
            self._cursor.consumed += count

        def skipping(original, iterator):
            if self._skip_extra:
                extra, self._skip_extra = self._skip_extra, 0
                consume(iterator, extra)
            if self._skip_calls:
                self._skip_calls -= 1
                self._skipped_last_call = True
                consume(iterator, spe)
                if not self._skip_calls:
                    self._skipping.remove()
                return self.model.get_metrics_result()
            self._skipped_last_call = False
            self._skipping.remove()
            return original(iterator)

        self._skipping.install(self.model, lambda function: _bind(skipping, function))

    # -- saving ----------------------------------------------------------------

    def _callbacks(self) -> list:
        """The callbacks of this fit (a plain Keras fit passes none)."""
        return list(getattr(self._context, "callbacks", []))

    def _position(self) -> dict:
        cursor = self._cursor
        return {
            "epoch": self._epoch,
            "step": self._step,
            "created": cursor.created,
            "consumed": cursor.consumed,
            "persistent": cursor.persistent,
            "kind": cursor.kind,
        }

    def _save(self, final: bool = False, wait: bool = False) -> None:
        """Starts the next backup; `final`: the last one of a finished fit;
        `wait`: returns once it is committed.

        The state is copied to host memory now, at this step boundary, by
        every worker; the chief's thread writes, seals and commits the copy
        while training goes on (the write in flight before it is waited for
        first, and its error raised here).
        """
        self._writes.wait()
        groups = self._groups()
        sequence = self._sequence + 1
        snapshot = _background_write.Snapshot.of(groups, self._buffers)
        callbacks, arrays = callback_states.collect(self._callbacks(), self)
        state = {
            "format": _FORMAT,
            "sequence": sequence,
            "position": self._position(),
            "data": {
                "seed": getattr(self._cursor, "seed", None),
                "order": _ORDER,
                "fingerprint": self._session.data_fingerprint()
                if self._session is not None and self._chief else None,
            },
            "fit": self._fit_arguments(),
            "variables": {k: _resume.describe(v) for k, v in groups.items()},
            "callbacks": callbacks,
            "final": final,
            "time": time.time(),
        }
        self._sequence = sequence
        self._since_save = 0
        self._last_save_time = time.monotonic()
        self._asked.discard("timed")
        if not self._chief:
            return  # only the chief's files persist
        self._writes.start(lambda: self._write(sequence, snapshot, arrays, state))
        if wait:
            self._writes.wait()

    def _write(self, sequence: int, snapshot, arrays: dict, state: dict) -> None:
        """Writes, seals and commits backup `sequence` (the writing thread)."""
        target = os.path.join(
            self.backup_dir,
            f"{store.TMP_PREFIX}{store.backup_name(sequence)}-{os.getpid()}",
        )
        try:
            if os.path.exists(target):
                shutil.rmtree(target)
            os.makedirs(target)
            snapshot.write(os.path.join(target, "variables"), self._host)
            if arrays:
                np.savez(os.path.join(target, "arrays.npz"), **arrays)
            store.write_json(os.path.join(target, store.STATE), state)
            store.seal(target)
            store.commit(target, self.backup_dir, sequence)
            store.prune(self.backup_dir, self.max_to_keep)
        except (OSError, tf.errors.OpError) as error:
            raise self._save_failed(sequence, error) from error
        finally:
            if os.path.exists(target):
                shutil.rmtree(target, ignore_errors=True)

    def wait_until_finished(self) -> None:
        """Returns once the backup being written (if any) is committed.

        A save copies the training state at its step boundary and writes it
        while training goes on; the end of `fit`, a preemption and the next
        save wait for it on their own. Call this where your code needs the
        newest backup on disk now (before reading `backup_dir` from a
        callback, say).

        Raises:
            RuntimeError: if that write failed (the backups saved before it
                are intact).
        """
        self._writes.wait()

    def _save_failed(self, sequence: int, error: Exception) -> RuntimeError:
        kept = store.list_backups(self.backup_dir) if self._chief else []
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return RuntimeError(
            f"BackupAndRestore: writing backup {sequence} to "
            f"{self.backup_dir!r} failed ({type(error).__name__}: {first}). "
            + (
                f"The backups already saved are intact (newest: "
                f"{store.backup_name(kept[0])}): fix the cause (disk space, "
                "permissions) and run the same fit again to resume from it."
                if kept else
                "Fix the cause (disk space, permissions) and run again."
            )
        )

    # -- Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        # Whatever an interrupted earlier fit left (it raised before
        # on_train_end) is undone first, its last write finished.
        self._settle()
        self._undo()
        self._reset_run()
        context = self._session
        self._context = context
        self._cursor = context.cursor if context is not None else (
            _data.DataCursor("unknown", persistent=False)
        )
        # A DistributedModel's or ShardedModel's fit chose the backup just
        # before (it needs the shuffle seed first); a plain Keras fit
        # chooses now, from the disk.
        state = self._select(
            _collectives.group_of(self.model), fresh=context is None
        )
        chosen, _, newest = self._selected
        self._sequence = newest
        if state is not None:
            plan = getattr(context, "resume", None)
            self._restore(plan or self._plan(chosen, state, self.model))
        self._signals.install(self.preemption_signals, self._warn_once)
        self._requests = self._start_requests()
        # Begin hooks need hiding only in a resumed run that skips batches.
        self._siblings.install(self, self._callbacks(), self._finish_batch,
                               hide_begin=bool(self._skip_calls))

    def _start_requests(self):
        """Under multi-worker training, preemption signals and timed saves
        are agreed through the job's key-value store, not by a collective
        after every batch (see `_save_requests`)."""
        if not (
            self._multi_worker
            and (self.preemption_signals or self.save_every_seconds)
            and _save_requests.available()
        ):
            return None
        info = _collectives.process_info(self._strategy)
        return _save_requests.SaveRequests(info.rank, info.num_workers, info.is_chief)

    def on_epoch_begin(self, epoch, logs=None):
        if self._pending_epoch_save:
            self._pending_epoch_save = False
            self._save_if_callbacks_changed(epoch)
        self._epoch, self._step = epoch, 0
        if self._pending_plan is not None:
            plan, self._pending_plan = self._pending_plan, None
            self._apply_plan(plan)

    def _save_if_callbacks_changed(self, epoch: int) -> None:
        """Callbacks after this one in the list updated their state for the
        finished epoch after it was saved: save again if they did."""
        states = callback_states.collect(self._callbacks(), self)
        changed = not callback_states.same(states, self._saved_states)
        if self._multi_worker:
            changed = _collectives.agree_any(self._strategy, [changed])[0]
        if changed:
            self._epoch, self._step = epoch, 0
            self._save()

    def _apply_plan(self, plan: _resume.ResumePlan) -> None:
        """The restored epoch begins: the rest of the backup's state."""
        _keras_compat.set_initial_epoch(self.model, None)
        callback_states.apply(self._callbacks(), self, plan.state.get("callbacks", {}),
                              plan.directory)
        # Keras still calls the batch hooks for the steps a resumed run
        # skips; callbacks whose state was restored would count them twice.
        # (Keras' progress bar is not in the list and moves past them.)
        self._siblings.hide_until = plan.hidden_batches
        # Keras resets the metrics just before on_epoch_begin: the running
        # means of the interrupted epoch are restored now.
        metrics = list(self.model.metrics_variables)
        if plan.restores_metrics(_resume.describe(metrics)):
            tf.train.Checkpoint(metrics=metrics).read(
                os.path.join(plan.directory, "variables")
            ).expect_partial()
        self._position_input(plan)
        self._step = 0

    def _position_input(self, plan: _resume.ResumePlan) -> None:
        target = plan.input_target()
        if target is None:
            return
        if self._context is None:
            # A plain keras.Model: an epoch boundary is a fresh pass;
            # mid-epoch, the skip over a fresh pass is all.
            if plan.step or plan.position.get("persistent"):
                self._warn_once("plain", self._untracked_input(plan))
            return
        if self._cursor.kind not in ("arrays", "dataset"):
            self._warn_once(
                "kind",
                "BackupAndRestore: this input (a generator, PyDataset or "
                "Keras-shuffled arrays) cannot be positioned; epoch "
                f"{plan.epoch + 1} resumes at step {plan.step} by skipping "
                "that many batches of a fresh pass, so some batches may be "
                "seen twice or not at all.",
            )
            return
        if (self._cursor.passes is not None and plan.step > 0
                and plan.state.get("data", {}).get("order") != _ORDER):
            self._warn_once(
                "order",
                "BackupAndRestore: this backup was written by an earlier "
                "keras_dist, which ordered shuffled arrays another way; epoch "
                f"{plan.epoch + 1} resumes at step {plan.step} of a pass in "
                "this version's order, so some samples of that epoch may be "
                "seen twice or not at all.",
            )
        if not self._cursor.advance_to(target):
            self._warn_once(
                "cursor",
                "BackupAndRestore: the input could not be positioned "
                f"(iterator {self._cursor.created} already created, backup at "
                f"{target}); the resumed epoch may see a different order.",
            )

    @staticmethod
    def _untracked_input(plan: _resume.ResumePlan) -> str:
        return (
            "BackupAndRestore: with a plain keras.Model the input's order is "
            f"not tracked; epoch {plan.epoch + 1} resumes at step {plan.step} by "
            "skipping that many batches of a fresh pass over the input, which "
            "matches the interrupted run only for unshuffled input. Use "
            "keras_dist.distribute(model) for an exact resume."
        )

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        self._step = batch + 1
        if self._skipped_last_call:
            self._skipped_last_call = False
            return
        done = batch - self._begin + 1
        self._calls += 1
        self._cursor.consumed += done
        self._since_save += done
        due, preempted = self._save_due()
        if due:
            self._pending = (preempted,)
            if not self._siblings.deferred:
                self._finish_batch()

    def _save_due(self) -> tuple[bool, bool]:
        """Whether a backup is due after this batch, and whether it is
        because of a preemption signal (every worker agrees on both)."""
        by_steps = self.save_freq != "epoch" and self._since_save >= self.save_freq
        timed = bool(
            self.save_every_seconds
            and time.monotonic() - self._last_save_time >= self.save_every_seconds
        )
        preempted = self._signals.received.is_set()
        if self._requests is not None:
            # A request is posted once; the save comes at the batch every
            # worker agreed on, where the reasons are agreed too.
            ask = tuple(
                reason
                for reason, wanted in (("timed", timed and self._chief), ("preempted", preempted))
                if wanted and reason not in self._asked
            )
            self._asked.update(ask)
            if not self._requests.at_batch_end(self._calls, ask):
                return by_steps, False
            preempted = _collectives.agree_any(self._strategy, [preempted])[0]
            return True, preempted
        if self._multi_worker and (self.save_every_seconds or self._signals.installed):
            timed, preempted = _collectives.agree_any(
                self._strategy, [timed, preempted]
            )
        return by_steps or timed or preempted, preempted

    def _finish_batch(self) -> None:
        """Writes the backup due at this batch, once every callback saw it."""
        if self._pending is None:
            return
        (preempted,), self._pending = self._pending, None
        self._save(wait=preempted)
        if preempted:
            self._exit_preempted(f"at epoch {self._epoch + 1}, step {self._step}")

    def _exit_preempted(self, where: str):
        self._signals.restore()
        self._skipping.remove()
        if self._requests is not None:
            self._requests.close(end_watchers=True)
        self._selected = None
        _liveness.note_saved(self.backup_dir, self._epoch + 1, self._step)
        if self._chief:
            print(
                f"BackupAndRestore: preemption signal received; backup saved {where}. "
                f"Exiting with status {PREEMPTED_EXIT_CODE}.",
                flush=True,
            )
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_epoch_end(self, epoch, logs=None):
        self._siblings.hide_until = 0
        if self.save_freq != "epoch":
            return
        # The finished epoch is committed now, as Keras does: a job stopped
        # before the next epoch starts never repeats it.
        current = self._epoch, self._step
        self._epoch, self._step = epoch + 1, 0
        try:
            self._save()
        finally:
            self._epoch, self._step = current
        self._saved_states = callback_states.collect(self._callbacks(), self)
        self._pending_epoch_save = True

    def on_train_end(self, logs=None):
        self._undo()
        # A signal that came after the last batch's check (or whose agreed
        # batch lies past the end of training) is acted on here.
        preempted = self._signals.received.is_set()
        if self._multi_worker and (self.preemption_signals or self.save_every_seconds):
            preempted = _collectives.agree_any(self._strategy, [preempted])[0]
        if self._requests is not None:
            self._requests.close(end_watchers=True)
        self._writes.wait()
        if preempted:
            self._epoch, self._step = self._epoch + 1, 0
            self._cursor.consumed = 0
            self._save(final=True, wait=True)
            self._exit_preempted(f"at the end of training (epoch {self._epoch})")
        if self.delete_checkpoint:
            if self._chief:
                store.delete_all(self.backup_dir)
        else:
            # The final state: a later fit with this backup trains no more.
            self._epoch, self._step = self._epoch + 1, 0
            self._cursor.consumed = 0
            self._save(final=True, wait=True)
        self._buffers.clear()
        self._host.clear()
        store.unlock(self.backup_dir)
        _keras_compat.set_initial_epoch(self.model, None)
        self._selected = None
        self._reset_run()


def backup_groups(model, build_optimizer: bool = True, saved: dict | None = None,
                  global_seed: bool = True) -> dict:
    """The variables a backup holds, by group, in the order they are saved
    (also what `keras_dist.SidecarEvaluator` restores).

    The model group ends with the state of Keras' global SeedGenerator
    where the process has one (made by the first unseeded `keras.random`
    call, not by the model). To restore a backup (`saved`: its variables'
    descriptions) that state is there where the backup holds it, made
    first if this process has none yet (the random stream goes on where
    the backed-up run was), and left out where the backup has none (this
    process's own stays as it is). `global_seed=False`: never (an
    evaluator's process keeps its own random state)."""
    sharded = getattr(model, "__keras_dist_backup_variables__", None)
    if sharded is not None:
        # A keras_dist.dtensor.ShardedModel: its state gathered from the
        # mesh into host variables (scattered back by `__keras_dist_restore_backup_variables__`).
        groups = sharded()
        own, optimizer_variables = groups["model"], groups["optimizer"]
    else:
        optimizer = model.optimizer
        if build_optimizer and optimizer is not None and not optimizer.built and model.built:
            optimizer.build(model.trainable_variables)
        own = list(model.variables)
        optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    if not global_seed:
        seed = []
    elif saved is None:
        seed = _keras_compat.global_seed_variables()
    else:
        seed = (_keras_compat.global_seed_variables(create=True)
                if holds_global_seed(saved.get("model", []), len(own)) else [])
    return {
        "model": own + seed,
        "optimizer": optimizer_variables,
        "metrics": list(model.metrics_variables),
    }


def holds_global_seed(saved_model: list, own: int) -> bool:
    """Whether a backup's model group (descriptions) ends with the global
    SeedGenerator's state after a model's `own` variables."""
    return len(saved_model) == own + 1 and (
        str(saved_model[-1][0]).endswith("seed_generator_state")
        and list(saved_model[-1][1]) == [2])


def _bind(skipping, original):
    return lambda iterator: skipping(original, iterator)


def _check_backup_dir(backup_dir) -> None:
    if backup_dir is None or (
        isinstance(backup_dir, (str, os.PathLike)) and not os.fspath(backup_dir)
    ):
        # Keras' error (and its type) for a missing directory.
        raise ValueError(
            "Empty `backup_dir` argument passed. Expected a non-empty "
            f"path. Received: backup_dir={backup_dir!r}"
        )
    if not isinstance(backup_dir, (str, os.PathLike)):
        raise TypeError(
            "Invalid type for argument `backup_dir`. Expected a non-empty "
            f"path. Received: backup_dir={backup_dir!r}"
        )


def _check_keep(max_to_keep, double_checkpoint: bool) -> None:
    if not _checks.is_positive_int(max_to_keep):
        raise ValueError(
            "Invalid value for argument `max_to_keep`. Expected a positive "
            f"integer. Received: max_to_keep={max_to_keep!r}"
        )
    if double_checkpoint and max_to_keep < 2:
        raise ValueError(
            "Arguments `double_checkpoint=True` and `max_to_keep` conflict: "
            "a fallback backup needs max_to_keep >= 2. Received: "
            f"max_to_keep={max_to_keep}"
        )
