"""BackupAndRestore's save requests (`keras_dist/callbacks/_save_requests.py`):
the agreement protocol under many interleavings, against an in-process key
store with the coordination service's semantics (a set never overwrites; a
get waits). Workers are threads that train in lockstep (a barrier per step
stands for the step's all-reduce) while their watchers run the real code;
the multi-worker tests (tests/multi_worker/test_backup_jobs.py,
tests/reliability/test_interruptions.py) run it on TensorFlow's own
coordination service."""

import random
import threading
import time

import pytest

from keras_dist import _keras_compat
from keras_dist.callbacks import _save_requests


class KeyStore:
    def __init__(self):
        self.values, self.cond = {}, threading.Condition()
        self.sets = 0

    def set(self, key, value):
        with self.cond:
            if key in self.values:
                raise _keras_compat.KeyExists(key)
            self.values[key] = value
            self.sets += 1
            self.cond.notify_all()

    def wait(self, key, timeout_s):
        with self.cond:
            self.cond.wait_for(lambda: key in self.values, timeout_s)
            return self.values.get(key)


@pytest.fixture
def store(monkeypatch):
    keys = KeyStore()
    monkeypatch.setattr(_keras_compat, "set_key", keys.set)
    monkeypatch.setattr(_keras_compat, "wait_for_key", keys.wait)
    return keys


def train(store, workers, steps, asks, rng, namespace):
    """Runs `workers` lockstep workers for `steps` steps; `asks` maps
    (worker, step) -> reason. Returns each worker's save steps."""
    step_all_reduce = threading.Barrier(workers, timeout=10)
    saves = [[] for _ in range(workers)]
    errors = []

    def worker(rank):
        requests = _save_requests.SaveRequests(rank, workers, rank == 0, namespace)
        try:
            for step in range(1, steps + 1):
                step_all_reduce.wait()  # no worker finishes a step alone
                time.sleep(rng.random() * 0.002)
                ask = (asks[(rank, step)],) if (rank, step) in asks else ()
                if requests.at_batch_end(step, ask):
                    saves[rank].append(step)
                    step_all_reduce.wait()  # the save's own agreement
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            step_all_reduce.abort()
        finally:
            requests.close(end_watchers=True)
            requests.join(2.0)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return saves


@pytest.mark.parametrize("seed", range(12))
def test_every_worker_saves_after_the_same_steps_whoever_asks_and_when(store, seed):
    rng = random.Random(seed)
    workers, steps = rng.choice([2, 3, 4]), 40
    asks = {(rng.randrange(workers), rng.randrange(1, steps - 2)): rng.choice(["preempted", "timed"])
            for _ in range(rng.randrange(1, 6))}
    saves = train(store, workers, steps, asks, rng, f"seed-{seed}")
    assert all(s == saves[0] for s in saves), saves
    # Each request is saved for, after the step it was made at and at most
    # one step after every worker had finished that step's successor.
    for (_, step) in asks:
        assert any(step < s <= step + 2 for s in saves[0]), (asks, saves)
    assert saves[0] == sorted(set(saves[0]))


def test_a_request_saves_after_the_step_that_follows_it(store):
    saves = train(store, 2, 12, {(1, 5): "preempted"}, random.Random(0), "next")
    assert saves == [[6], [6]]


def test_no_request_no_save_and_no_key_but_the_end(store):
    saves = train(store, 3, 30, {}, random.Random(0), "quiet")
    assert saves == [[], [], []]
    assert store.sets == 1  # the chief's end, for the watchers
    assert list(store.values) == ["keras_dist/backup-requests/quiet/request/0"]
