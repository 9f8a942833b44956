"""`BackupAndRestore`: exact, atomic, multi-worker-safe training backups."""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Literal

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _backup_store as store
from keras_dist import _exit_codes
from keras_dist import _collectives
from keras_dist import _data
from keras_dist import _fit_session
from keras_dist import _keras_compat
from keras_dist.strategy import worker_info

PREEMPTED_EXIT_CODE = _exit_codes.PREEMPTED
"""Exit status of a process that saved a backup on a preemption signal."""

_FORMAT = store.FORMAT
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}

# Attributes of Keras' stateful callbacks that a resumed run needs. Callbacks
# that define `get_state()` / `set_state(state)` are saved through those.
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
    sha256 of its files, and a damaged backup is skipped, with a warning
    naming the bad file, in favour of the previous one. Under
    `MultiWorkerMirroredStrategy` every worker takes part in each save, only
    the chief's files persist, and all workers restore the same backup.

    On a preemption signal (SIGTERM by default) the workers agree on the next
    step boundary, save there and exit with status `PREEMPTED_EXIT_CODE`
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
        save_every_seconds: Optional positive number: also back up at the
            first step boundary after this many seconds since the last
            backup (agreed across workers).
        preemption_signals: Signals that trigger a save-and-exit at the next
            step boundary, default `(signal.SIGTERM,)`. `None` or `()`
            disables it. Handlers are installed from the main thread only.

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
        preemption_signals: Sequence[int] | None = (signal.SIGTERM,),
    ):
        super().__init__()
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
        if save_freq != "epoch" and not _is_positive_int(save_freq):
            raise ValueError(
                "Invalid value for argument `save_freq`. Expected \"epoch\" or "
                f"a positive integer. Received: save_freq={save_freq!r}"
            )
        for name, value in (
            ("double_checkpoint", double_checkpoint),
            ("delete_checkpoint", delete_checkpoint),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"Invalid type for argument `{name}`. Expected a bool. "
                    f"Received: {name}={value!r}"
                )
        if not _is_positive_int(max_to_keep):
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
        if save_every_seconds is not None and (
            not isinstance(save_every_seconds, (int, float))
            or isinstance(save_every_seconds, bool)
            or not save_every_seconds > 0
        ):
            raise ValueError(
                "Invalid value for argument `save_every_seconds`. Expected None "
                f"or a positive number. Received: save_every_seconds={save_every_seconds!r}"
            )
        signals = []
        for value in preemption_signals or ():
            try:
                sig = signal.Signals(value)
            except (ValueError, TypeError):
                raise ValueError(
                    "Invalid value for argument `preemption_signals`. Expected "
                    f"signal numbers such as signal.SIGTERM. Received: {value!r}"
                ) from None
            if sig in _UNCATCHABLE:
                raise ValueError(
                    "Invalid value for argument `preemption_signals`: "
                    f"{sig.name} cannot be caught. Received: {value!r}. Use "
                    "SIGTERM, SIGUSR1 or another catchable signal."
                )
            signals.append(sig)
        # Configuration: survives across fit() calls.
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = int(max_to_keep)
        self.save_every_seconds = save_every_seconds
        self.preemption_signals = tuple(signals)
        self._selected = None  # chosen backup, from selection to end of fit
        self._session = None  # the DistributedModel.fit session, during one
        self._skipping = _fit_session.TrainFunctionOverride()
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
        self._resume = None  # state of the restored backup until applied
        self._skip_calls = 0
        self._skip_extra = 0
        self._skipped_last_call = False
        self._signal_event = threading.Event()
        self._previous_handlers = {}
        self._warned = set()
        self._hooked = []  # (callback, hook name) wrapped for this fit
        self._deferred = False  # the batch-end save waits for later callbacks
        self._pending = None  # a save due at this batch: (preempted,)
        self._skip_until = 0

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
        self._session = session
        session.resumed = self._select(session.strategy, fresh=True)
        session.add_teardown(self._release)

    def _select(self, strategy, fresh: bool = False):
        """Chooses (once per fit) the backup to restore; None when none.

        `fresh` drops a choice left by an earlier fit that never reached
        `on_train_end` (it raised): a new fit looks at the disk again.
        """
        self._strategy = strategy
        info = worker_info(strategy)
        self._chief = info.is_chief
        self._multi_worker = _collectives.is_multi_worker(strategy)
        if fresh:
            self._selected = None
        if self._selected is not None:
            return self._selected[1]
        self._check_dir()
        chosen, state = 0, None
        if self._chief:
            store.remove_stale_tmp(self.backup_dir)
            for sequence in store.list_backups(self.backup_dir):
                directory = os.path.join(self.backup_dir, store.backup_name(sequence))
                try:
                    state = store.verify(directory)
                except store.CorruptBackupError as error:
                    warnings.warn(
                        f"BackupAndRestore: skipping damaged backup {directory}: "
                        f"{error.path}: {error.reason}. Trying the previous one.",
                        stacklevel=2,
                    )
                    continue
                chosen = sequence
                break
        chosen = _collectives.agree_sum(strategy, [chosen])[0]
        if chosen and state is None:  # the chief verified its choice above
            directory = os.path.join(self.backup_dir, store.backup_name(chosen))
            try:
                state = store.verify(directory)
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

    def _release(self) -> None:
        """Undoes what a fit that did not reach `on_train_end` left behind."""
        self._unmute_siblings()
        self._unhook_siblings()
        self._restore_handlers()
        self._skipping.remove()
        self._selected = None
        self._session = None

    def _groups(self) -> dict:
        model = self.model
        sharded = getattr(model, "_backup_variables", None)
        if sharded is not None:
            # A keras_dist.dtensor.ShardedModel: its state gathered from the
            # mesh into host variables (restored by `_restore_backup_variables`).
            groups = sharded()
            return {
                "model": groups["model"] + _keras_compat.global_seed_variables(),
                "optimizer": groups["optimizer"],
                "metrics": list(model.metrics_variables),
            }
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built and model.built:
            optimizer.build(model.trainable_variables)
        return {
            "model": list(model.variables) + _keras_compat.global_seed_variables(),
            "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "metrics": list(model.metrics_variables),
        }

    @staticmethod
    def _describe(variables) -> list:
        return [[v.path, list(v.shape), str(v.dtype)] for v in variables]

    def _check_compatible(self, saved: dict, groups: dict) -> None:
        """Variables are matched by position, shape and dtype.

        Paths carry Keras' auto-numbered names (`dense_3`), which differ
        between two models built in one process, so they only serve to name
        the variables in the error.
        """
        problems = []
        for group in ("model", "optimizer"):
            ours = self._describe(groups[group])
            theirs = [list(d) for d in saved.get(group, [])]
            if [d[1:] for d in ours] == [d[1:] for d in theirs]:
                continue
            gone = sorted({_generic(d[0]) for d in theirs} - {_generic(d[0]) for d in ours})
            new = sorted({_generic(d[0]) for d in ours} - {_generic(d[0]) for d in theirs})
            detail = [f"{group}: the backup has {len(theirs)} variables, the model {len(ours)}"]
            if gone:
                detail.append("only in the backup: " + _shorten(gone))
            if new:
                detail.append("only in the model: " + _shorten(new))
            differ = [
                f"{o[0]} (model {o[1]} {o[2]}, backup {t[1]} {t[2]})"
                for o, t in zip(ours, theirs)
                if o[1:] != t[1:]
            ]
            if differ and not (gone or new):
                detail.append("different shape or dtype: " + _shorten(differ))
            problems.append("; ".join(detail))
        if problems:
            raise ValueError(
                "BackupAndRestore: the backup in "
                f"{self.backup_dir!r} was written by a different model. "
                + ". ".join(problems)
                + ". Restore it into the model that wrote it, or point "
                "`backup_dir` at an empty directory to start over."
            )

    def _restore(self, state: dict, sequence: int) -> None:
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore: the model has no variables to restore the "
                f"backup in {self.backup_dir!r} into: Keras builds this model "
                "at its first training step, after the backup must be "
                "restored. Build it before fit (call it on one batch of "
                "inputs, or model.build(input_shape)), or wrap it with "
                "keras_dist.distribute(model), which builds it first."
            )
        groups = self._groups()
        saved = state["variables"]
        self._check_compatible(saved, groups)
        directory = os.path.join(self.backup_dir, store.backup_name(sequence))
        checkpoint = tf.train.Checkpoint(
            model=groups["model"], optimizer=groups["optimizer"]
        )
        checkpoint.read(os.path.join(directory, "variables")).expect_partial()
        if hasattr(self.model, "_restore_backup_variables"):
            self.model._restore_backup_variables()  # onto the mesh's shards
        self._warn_changes(state.get("fit", {}))
        self._resume = state
        self._resume_dir = directory
        position = state["position"]
        _keras_compat.set_initial_epoch(self.model, position["epoch"])
        spe = max(1, int(self.model.steps_per_execution or 1))
        step = int(position["step"])
        self._skip_calls = math.ceil(step / spe)
        if position.get("persistent"):
            self._skip_extra = max(0, int(position["consumed"]) - step)
        if step % spe:
            self._warn_once(
                "spe",
                f"BackupAndRestore: the backup stopped at step {step}, not a "
                f"multiple of steps_per_execution={spe}; the resumed epoch "
                f"restarts at step {self._skip_calls * spe}.",
            )
        if self._skip_calls or self._skip_extra:
            self._wrap_train_function()
        if self._chief:
            print(
                f"BackupAndRestore: restored {directory} (epoch {position['epoch'] + 1}, "
                f"step {step})",
                flush=True,
            )

    def _warn_changes(self, saved: dict) -> None:
        current = self._fit_arguments()
        changes = [
            f"{key} {saved[key]} -> {current[key]}"
            for key in sorted(current)
            if saved.get(key) is not None
            and current[key] is not None
            and saved[key] != current[key]
        ]
        if changes:
            self._warn_once(
                "changes",
                "BackupAndRestore: this fit differs from the backed-up run ("
                + ", ".join(changes)
                + "); the resumed run will not match an uninterrupted one.",
            )

    def _fit_arguments(self) -> dict:
        context = self._context
        return {
            "epochs": self.params.get("epochs"),
            "steps_per_epoch": self.params.get("steps"),
            "num_samples": getattr(context, "num_samples", None),
            "batch_size": getattr(context, "batch_size", None),
            "steps_per_execution": int(self.model.steps_per_execution or 1),
        }

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self._chief:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # -- skipping the batches already trained ------------------------------

    def _wrap_train_function(self) -> None:
        spe = max(1, int(self.model.steps_per_execution or 1))

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

    def _hook_siblings(self) -> None:
        """Puts this callback's batch-end work after every other callback's.

        A backup holds the other callbacks' state, so it is written once all
        of them have seen the batch (Keras calls them in list order, and
        some are listed after this one). The same wrappers hide the batches
        a resumed run skips (see `_mute_siblings`). If a callback raises, a
        backup due at that batch is written before the error propagates.
        Only the callbacks of a `DistributedModel.fit` are known here.
        """
        siblings = [
            c for c in getattr(self._context, "callbacks", []) if c is not self
        ]
        after = self in getattr(self._context, "callbacks", []) and (
            self._context.callbacks[-1] is not self
        )
        last = siblings[-1] if siblings and after else None
        # Begin hooks need hiding only in a resumed run that skips batches.
        hooks = ("on_train_batch_end",)
        if self._skip_calls:
            hooks = ("on_train_batch_begin",) + hooks
        for callback in siblings:
            for hook in hooks:
                original = getattr(callback, hook)
                finish = hook == "on_train_batch_end"
                tail = finish and callback is last

                def hooked(batch, logs=None, _original=original, _finish=finish,
                           _tail=tail):
                    if batch < self._skip_until:
                        return None
                    if not _finish:
                        return _original(batch, logs)
                    try:
                        result = _original(batch, logs)
                    except BaseException:
                        self._finish_batch()
                        raise
                    if _tail:
                        self._finish_batch()
                    return result

                # Keep a hook set on the instance (LambdaCallback) to put back.
                self._hooked.append((callback, hook, callback.__dict__.get(hook, _UNSET)))
                setattr(callback, hook, hooked)
        self._deferred = last is not None

    def _unhook_siblings(self) -> None:
        for callback, hook, previous in reversed(self._hooked):
            if previous is _UNSET:
                # The instance attribute shadows the class method; drop it.
                callback.__dict__.pop(hook, None)
            else:
                callback.__dict__[hook] = previous
        self._hooked = []
        self._deferred = False

    def _mute_siblings(self) -> None:
        """Hides the skipped steps from the other callbacks of this fit.

        Keras still calls the batch hooks for the steps a resumed run skips;
        callbacks whose state was restored would count them twice. (Keras'
        progress bar is not in the list and moves past them.)
        """
        spe = max(1, int(self.model.steps_per_execution or 1))
        self._skip_until = self._skip_calls * spe

    def _unmute_siblings(self) -> None:
        self._skip_until = 0

    # -- preemption signals --------------------------------------------------

    def _install_handlers(self) -> None:
        if not self.preemption_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            self._warn_once(
                "thread",
                "BackupAndRestore: fit runs outside the main thread, so "
                "preemption signals cannot be handled; backups still follow "
                "`save_freq`.",
            )
            return
        for sig in self.preemption_signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._signal_event.is_set() or not _inside_fit(frame):
            # A second signal, or the fit that installed this handler ended
            # with an exception (Keras calls no hook then): behave as if the
            # callback were not there.
            self._restore_handlers()
            signal.raise_signal(signum)
            return
        self._signal_event.set()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    # -- saving ----------------------------------------------------------------

    def _keyed_callbacks(self, legacy: bool = False) -> list:
        """(key, callback) for every other callback of the fit.

        A key is the callback's identity: its class and configuration
        (`monitor`, `mode`, `filepath`), numbered only among identical ones,
        so reordering the callback list does not mix their states up.
        `legacy`: the keys of backups written before (list positions).
        """
        keyed, seen = [], {}
        for index, callback in enumerate(getattr(self._context, "callbacks", [])):
            if callback is self:
                continue
            if legacy:
                keyed.append((f"{index}:{type(callback).__name__}", callback))
                continue
            key = _identity(callback)
            seen[key] = seen.get(key, 0) + 1
            keyed.append((key if seen[key] == 1 else f"{key} #{seen[key]}", callback))
        return keyed

    def _callback_states(self) -> tuple[dict, dict]:
        states, arrays = {}, {}
        for key, callback in self._keyed_callbacks():
            if callable(getattr(callback, "get_state", None)):
                states[key] = callback.get_state()
                continue
            for kind, names in _keras_compat.KERAS_CALLBACK_STATE.items():
                if isinstance(callback, kind):
                    states[key] = {n: _plain(getattr(callback, n, None)) for n in names}
                    weights = getattr(callback, "best_weights", None)
                    if weights is not None:
                        for i, w in enumerate(weights):
                            arrays[f"{key}/best_weights/{i}"] = np.asarray(w)
                        states[key]["best_weights"] = len(weights)
        return states, arrays

    def _apply_callback_states(self, state: dict, directory: str) -> None:
        saved = state.get("callbacks", {})
        arrays = None
        legacy = bool(saved) and all(_LEGACY_KEY.match(key) for key in saved)
        for key, callback in self._keyed_callbacks(legacy):
            if key not in saved:
                continue
            values = dict(saved[key])
            if callable(getattr(callback, "set_state", None)):
                callback.set_state(values)
                continue
            count = values.pop("best_weights", None)
            for name, value in values.items():
                setattr(callback, name, value)
            if count is not None:
                if arrays is None:
                    arrays = np.load(os.path.join(directory, "arrays.npz"))
                callback.best_weights = [
                    arrays[f"{key}/best_weights/{i}"] for i in range(count)
                ]

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

    def _save(self) -> None:
        groups = self._groups()
        sequence = self._sequence + 1
        if self._chief:
            target = os.path.join(
                self.backup_dir,
                f"{store.TMP_PREFIX}{store.backup_name(sequence)}-{os.getpid()}",
            )
            if os.path.exists(target):
                shutil.rmtree(target)
            os.makedirs(target)
        else:
            target = tempfile.mkdtemp(prefix="keras_dist_backup_")
        try:
            checkpoint = tf.train.Checkpoint(**groups)
            checkpoint.write(os.path.join(target, "variables"))
            callbacks, arrays = self._callback_states()
            if arrays:
                np.savez(os.path.join(target, "arrays.npz"), **arrays)
            state = {
                "format": _FORMAT,
                "sequence": sequence,
                "position": self._position(),
                "data": {"seed": getattr(self._cursor, "seed", None)},
                "fit": self._fit_arguments(),
                "variables": {k: self._describe(v) for k, v in groups.items()},
                "callbacks": callbacks,
                "time": time.time(),
            }
            store.write_json(os.path.join(target, store.STATE), state)
            if self._chief:
                store.seal(target)
                store.commit(target, self.backup_dir, sequence)
                store.prune(self.backup_dir, self.max_to_keep)
        except (OSError, tf.errors.OpError) as error:
            kept = store.list_backups(self.backup_dir) if self._chief else []
            raise RuntimeError(
                f"BackupAndRestore: writing backup {sequence} to "
                f"{self.backup_dir!r} failed ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). "
                + (
                    f"The backups already saved are intact (newest: "
                    f"{store.backup_name(kept[0])}): fix the cause (disk space, "
                    "permissions) and run the same fit again to resume from it."
                    if kept else
                    "Fix the cause (disk space, permissions) and run again."
                )
            ) from error
        finally:
            if not self._chief or os.path.exists(target):
                shutil.rmtree(target, ignore_errors=True)
        self._sequence = sequence
        self._since_save = 0
        self._last_save_time = time.monotonic()

    # -- Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        # Whatever an interrupted earlier fit left (it raised before
        # on_train_end) is undone first.
        self._unmute_siblings()
        self._unhook_siblings()
        self._restore_handlers()
        self._skipping.remove()
        self._reset_run()
        context = self._session
        self._context = context
        self._cursor = context.cursor if context is not None else (
            _data.DataCursor("unknown", persistent=False)
        )
        # A DistributedModel's fit chose the backup just before (it needs
        # the shuffle seed first); any other fit chooses now, from the disk.
        state = self._select(
            self.model.distribute_strategy, fresh=context is None
        )
        chosen, _, newest = self._selected
        self._sequence = newest
        if state is not None:
            if state.get("format") != _FORMAT:
                raise ValueError(
                    f"BackupAndRestore: backup {chosen} in {self.backup_dir!r} "
                    f"has format {state.get('format')!r}; this version reads "
                    f"format {_FORMAT}."
                )
            self._restore(state, chosen)
        self._install_handlers()
        self._hook_siblings()

    def on_epoch_begin(self, epoch, logs=None):
        if self._pending_epoch_save:
            self._pending_epoch_save = False
            # Callbacks after this one in the list updated their state for the
            # finished epoch after it was saved: save again if they did.
            changed = not _same_states(self._callback_states(), self._saved_states)
            if self._multi_worker:
                changed = _collectives.agree_any(self._strategy, [changed])[0]
            if changed:
                self._epoch, self._step = epoch, 0
                self._save()
        self._epoch, self._step = epoch, 0
        if self._resume is not None:
            state, self._resume = self._resume, None
            _keras_compat.set_initial_epoch(self.model, None)
            self._apply_callback_states(state, self._resume_dir)
            self._mute_siblings()
            # Keras resets the metrics just before on_epoch_begin: the
            # running means of the interrupted epoch are restored now.
            metrics = list(self.model.metrics_variables)
            # At step 0 (a backup taken at an epoch's end) the epoch starts
            # with fresh running means, as Keras just reset them.
            if (
                metrics
                and int(state["position"]["step"]) > 0
                and self._describe(metrics) == state["variables"].get("metrics")
            ):
                tf.train.Checkpoint(metrics=metrics).read(
                    os.path.join(self._resume_dir, "variables")
                ).expect_partial()
            self._position_input(state["position"])
            self._step = 0

    def _position_input(self, position: dict) -> None:
        step = int(position["step"])
        if position["epoch"] == 0 and step == 0 and not position.get("persistent"):
            return
        kind = self._cursor.kind
        if self._context is None and step == 0 and not position.get("persistent"):
            return  # an epoch boundary: a fresh pass is where it stood
        if self._context is None:
            sharded = hasattr(self.model, "_backup_variables")
            self._warn_once(
                "plain",
                "BackupAndRestore: with a "
                + ("ShardedModel" if sharded else "plain keras.Model")
                + " the input's order is not tracked; epoch "
                f"{position['epoch'] + 1} resumes at step {step} by skipping "
                "that many batches of a fresh pass over the input, which "
                "matches the interrupted run only for unshuffled input"
                + (" (shuffle=False, or a tf.data pipeline in a fixed order)."
                   if sharded else
                   ". Use keras_dist.distribute(model) for an exact resume."),
            )
            return
        if kind not in ("arrays", "dataset"):
            self._warn_once(
                "kind",
                "BackupAndRestore: this input (a generator, PyDataset or "
                "Keras-shuffled arrays) cannot be positioned; epoch "
                f"{position['epoch'] + 1} resumes at step {step} by skipping "
                "that many batches of a fresh pass, so some batches may be "
                "seen twice or not at all.",
            )
            return
        created = int(position["created"])
        target = created - 1 if (position.get("persistent") or step > 0) else created
        if not self._cursor.advance_to(target):
            self._warn_once(
                "cursor",
                "BackupAndRestore: the input could not be positioned "
                f"(iterator {self._cursor.created} already created, backup at "
                f"{target}); the resumed epoch may see a different order.",
            )

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        self._step = batch + 1
        if self._skipped_last_call:
            self._skipped_last_call = False
            return
        done = batch - self._begin + 1
        self._cursor.consumed += done
        self._since_save += done
        by_steps = self.save_freq != "epoch" and self._since_save >= self.save_freq
        timed = bool(
            self.save_every_seconds
            and time.monotonic() - self._last_save_time >= self.save_every_seconds
        )
        preempted = self._signal_event.is_set()
        if self._multi_worker and (self.save_every_seconds or self._previous_handlers):
            timed, preempted = _collectives.agree_any(
                self._strategy, [timed, preempted]
            )
        if by_steps or timed or preempted:
            self._pending = (preempted,)
            if not self._deferred:
                self._finish_batch()

    def _finish_batch(self) -> None:
        """Writes the backup due at this batch, once every callback saw it."""
        if self._pending is None:
            return
        (preempted,), self._pending = self._pending, None
        self._save()
        if preempted:
            self._restore_handlers()
            self._skipping.remove()
            self._selected = None
            if self._chief:
                print(
                    "BackupAndRestore: preemption signal received; backup "
                    f"saved at epoch {self._epoch + 1}, step {self._step}. "
                    f"Exiting with status {PREEMPTED_EXIT_CODE}.",
                    flush=True,
                )
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_epoch_end(self, epoch, logs=None):
        self._unmute_siblings()
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
        self._saved_states = self._callback_states()
        self._pending_epoch_save = True

    def on_train_end(self, logs=None):
        self._unmute_siblings()
        self._unhook_siblings()
        self._restore_handlers()
        self._skipping.remove()
        if self.delete_checkpoint:
            if self._chief:
                store.delete_all(self.backup_dir)
        else:
            # The final state: a later fit with this backup trains no more.
            self._epoch, self._step = self._epoch + 1, 0
            self._cursor.consumed = 0
            self._save()
        _keras_compat.set_initial_epoch(self.model, None)
        self._selected = None
        self._reset_run()


_UNSET = object()


def _inside_fit(frame) -> bool:
    """Whether Keras' `fit` is on the interrupted thread's stack."""
    fit = keras.Model.fit.__code__
    while frame is not None:
        if frame.f_code is fit:
            return True
        frame = frame.f_back
    return False


def _bind(skipping, original):
    return lambda iterator: skipping(original, iterator)


_LEGACY_KEY = re.compile(r"^\d+:\w+$")


def _identity(callback) -> str:
    cls = type(callback)
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for name in ("monitor", "mode", "filepath"):
        value = getattr(callback, name, None)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _same_states(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    """Whether two `_callback_states()` results hold the same states."""
    if a[0] != b[0] or a[1].keys() != b[1].keys():
        return False
    return all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


def _is_positive_int(value) -> bool:
    return (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and value > 0
    )


def _generic(path: str) -> str:
    """A variable path without Keras' auto-numbering (`dense_3` -> `dense`)."""
    return re.sub(r"_\d+(?=/|$)", "", path)


def _shorten(names: list) -> str:
    return ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")


def _plain(value):
    """JSON-friendly copy of a callback attribute."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, tf.Tensor):
        value = value.numpy().tolist()
    return value
