"""Save requests agreed by the workers of a job without a collective per step.

A preemption signal reaches one worker, and a timed save is the chief's
clock: every worker must save at the same step. Agreeing on that with a
collective after every batch costs each step a host round trip between
the workers (3-4 ms on a 7 ms step of 2 CPU workers). Instead, a worker
that wants a save posts a request in the job's key-value store (TensorFlow's
coordination service, which `MultiWorkerMirroredStrategy` runs), and each
worker's watcher thread, blocked on the next request's key, answers with
the number of batches its worker has finished. The save happens after
batch `max(answers) + 1` on every worker:

- no worker passes that batch before it knows it: a worker stops, at the
  end of the batch after the one its watcher answered, until every answer
  is in;
- no worker waits for one that cannot come: the watchers answer whatever
  their training threads are doing (blocked in a step's all-reduce
  included), so the wait lasts one round trip of the store.

A training step then costs one lock and a comparison; a request costs the
step after the next, about 2 ms of the store and a short wait.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref

from keras_dist import _keras_compat, _liveness

# One namespace per fit: every worker runs its fits in the same order, so
# the n-th fit of each process has the same number.
_FITS = itertools.count()
_OPEN: "weakref.WeakSet[SaveRequests]" = weakref.WeakSet()
_END = "end"
# How long a watcher blocks in the store before it looks at its stop flag,
# and how often a waiting training thread looks for a lost peer.
_WATCH_S = 1.0
_WAIT_LOOK_S = 0.1


def available() -> bool:
    """Whether the job has the key-value store these requests use."""
    return _keras_compat.key_store_available()


class SaveRequests:
    """The requests of one fit on one worker (see the module docstring).

    The training thread calls `at_batch_end` after each batch (with the
    reasons it requests a save for, if any; True: save now); `close` ends
    the watcher.
    """

    def __init__(self, rank: int, num_workers: int, chief: bool, namespace: str | None = None):
        # `namespace`: the keys' prefix (default: this process's next fit's).
        self._prefix = f"keras_dist/backup-requests/{namespace or next(_FITS)}"
        self._rank, self._num_workers, self._chief = rank, num_workers, chief
        self._cond = threading.Condition()
        self._completed = 0  # batches the training thread finished
        self._answered: dict[int, int] = {}  # request -> this worker's answer
        self._targets: set[int] = set()  # batches after which to save
        self._seen = 0  # requests the watcher has taken up
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="keras-dist-save-requests", daemon=True
        )
        _OPEN.add(self)
        self._thread.start()

    def _key(self, *parts) -> str:
        return "/".join((self._prefix, *map(str, parts)))

    # -- training thread ------------------------------------------------------

    def _ask(self, reason: str) -> None:
        with self._cond:
            index = self._seen
        try:
            _keras_compat.set_key(self._key("request", index), reason)
        except _keras_compat.KeyExists:
            # Another worker's request that this watcher had not taken up:
            # its batch comes after this one, and this worker's reasons are
            # read there.
            pass

    def at_batch_end(self, completed: int, ask: tuple = ()) -> bool:
        """Whether a save is agreed after batch number `completed` (counted
        from 1 over the whole fit); waits first while the save's batch is
        not yet known and could be this one.

        `ask`: reasons this worker requests a save for, now (a preemption
        signal, the chief's clock; they are for the record: every request
        is agreed the same way). This worker answers `completed`: the save
        comes after batch `completed + 1`, or later if a peer is ahead.
        """
        if ask:  # recorded before the request, so this worker answers it
            with self._cond:
                self._completed = completed
            for reason in ask:
                self._ask(reason)
        with self._cond:  # the one lock of a step without a request
            self._completed = completed
            while self._error is None and any(
                answer < completed for answer in self._answered.values()
            ):
                self._cond.wait(_WAIT_LOOK_S)
                if _liveness.peer_lost() and self._error is None:
                    self._error = RuntimeError("the launcher says a worker of this job failed")
            if self._error is not None:
                raise RuntimeError(
                    "BackupAndRestore: the workers could not agree on a backup "
                    "step through the job's key-value store (TensorFlow's "
                    "coordination service, served by the chief): "
                    f"{type(self._error).__name__}: "
                    f"{(str(self._error).splitlines() or [''])[0]}"
                ) from self._error
            if completed in self._targets:
                self._targets.discard(completed)
                return True
            return False

    def close(self, end_watchers: bool) -> None:
        """Ends this worker's watcher. `end_watchers` (every worker passed
        its last batch and agreed so, e.g. at the end of fit): the chief
        also tells every watcher to end now rather than at its next look."""
        self._stop.set()
        if not (end_watchers and self._chief):
            return
        with self._cond:
            index = self._seen
        try:
            while True:
                try:
                    _keras_compat.set_key(self._key("request", index), _END)
                    return
                except _keras_compat.KeyExists:
                    index += 1
        except Exception:  # noqa: BLE001 - the store is gone: the watchers end by their flag
            return

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # -- watcher thread ---------------------------------------------------------

    def _watch(self) -> None:
        index = 0
        try:
            while not self._stop.is_set():
                reason = _keras_compat.wait_for_key(self._key("request", index), _WATCH_S)
                if reason is None:
                    continue
                if reason == _END:
                    return
                with self._cond:
                    answer = self._answered[index] = self._completed
                    self._seen = index + 1
                _keras_compat.set_key(self._key("answer", index, self._rank), str(answer))
                answers = []
                for rank in range(self._num_workers):
                    value = None
                    while value is None:
                        if self._stop.is_set():
                            return
                        value = _keras_compat.wait_for_key(
                            self._key("answer", index, rank), _WATCH_S
                        )
                    answers.append(int(value))
                with self._cond:
                    del self._answered[index]
                    self._targets.add(max(answers) + 1)
                    self._cond.notify_all()
                index += 1
        except Exception as error:  # noqa: BLE001 - handed to the training thread
            with self._cond:
                self._error = error
                self._cond.notify_all()


@atexit.register
def _end_watchers() -> None:
    """A process that leaves a fit by an exception (or a preemption's exit)
    lets its watchers end before TensorFlow's runtime goes."""
    watchers = list(_OPEN)
    for requests in watchers:
        requests.close(end_watchers=False)
    for requests in watchers:
        requests.join(_WATCH_S + 0.5)
