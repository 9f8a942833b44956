"""The elastic leader's rules, event sequence by event sequence, without
processes or TensorFlow (keras_dist/launchers/elastic_policy.py).

A small simulated rendezvous plays the events of a job (hosts coming up,
a worker exiting with a status, a host's heartbeat going stale, time
passing) and asks the policy what the leader would decide every half second,
as `ElasticHost` does; each row names the generations that must follow and
how the job ends. The real-process goldens are tests/multi_worker/
test_elastic_jobs.py.
"""

import pytest

from keras_dist.launchers import elastic_policy as policy

pytestmark = pytest.mark.fast

TICK = 0.5
SETTLE = policy.SETTLE_SECONDS


class Rendezvous:
    """What the launchers share, with a clock that the events move."""

    def __init__(self, job: policy.Job):
        self.job = job
        self.now = 0.0
        self.alive: set[int] = set()
        self.leaving: set[int] = set()
        self.generations: list[dict] = []
        self.exits: dict[int, dict[int, dict]] = {}
        self.failed: str | None = None
        self.lost_since = None

    def lead(self) -> None:
        if self.failed is not None:
            return
        alive = sorted(self.alive)
        if not alive:
            return
        if not self.generations:
            proposal = policy.first_generation(
                self.job, [a for a in alive if a not in self.leaving], self.now)
        else:
            number = len(self.generations)
            proposal, self.lost_since = policy.next_generation(
                self.job, number, self.generations[-1], alive,
                self.exits.get(number, {}), self.now, self.lost_since,
                tuple(sorted(self.leaving)))
        if proposal is None:
            return
        if policy.ends_the_job(self.job, proposal):
            self.failed = policy.failure_reason(self.job, proposal)
            return
        self.lost_since = None
        self.generations.append({"members": list(proposal.members), "restarts": proposal.restarts,
                                 "time": self.now, "reason": proposal.reason,
                                 "save_first": proposal.save_first})

    def play(self, event: tuple) -> None:
        kind, *args = event
        if kind == "up":
            self.alive.update(args)
            self.leaving.difference_update(args)
        elif kind == "lost":  # the host (launcher and worker) is gone
            self.alive.difference_update(args)
        elif kind == "exit":  # a member's worker exited: its launcher records it
            rank, code = args
            self.exits.setdefault(len(self.generations), {})[rank] = {"code": code,
                                                                      "time": self.now}
        elif kind == "leaving":  # its launcher got SIGTERM; it beats while it saves
            self.leaving.update(args)
        elif kind == "preempted":  # saved, exited 42, and the host leaves
            (rank,) = args
            self.leaving.add(rank)
            self.play(("exit", rank, 42))
            self.alive.discard(rank)
        elif kind == "wait":
            end = self.now + args[0]
            while self.now < end - 1e-9:
                self.now += TICK
                self.lead()
            return
        self.lead()


def job(hosts=3, min_workers=1, max_restarts=0, rejoin_after=10.0, start_timeout=None):
    return policy.Job(hosts, min_workers, max_restarts, rejoin_after, start_timeout)


UP3 = [("up", 0, 1, 2)]

# (name, job, events, generations' members, restarts of the last, how it ends)
CASES = [
    ("all up at once", job(), UP3, [(0, 1, 2)], 0, None),
    ("hosts come up one by one", job(),
     [("up", 0), ("wait", 2), ("up", 1), ("wait", 2), ("up", 2)], [(0, 1, 2)], 0, None),
    ("enough after rejoin_after", job(min_workers=2),
     [("up", 0, 1), ("wait", 10)], [(0, 1)], 0, None),
    ("too few after rejoin_after: keep waiting", job(min_workers=3),
     [("up", 0, 1), ("wait", 30)], [], 0, None),
    ("start_timeout with too few ends the job", job(min_workers=3, start_timeout=20),
     [("up", 0, 1), ("wait", 20)], [], 0, "fewer than min_workers=3"),
    ("start_timeout with enough starts", job(min_workers=1, rejoin_after=100, start_timeout=5),
     [("up", 1), ("wait", 5)], [(1,)], 0, None),
    ("a crash restarts the same hosts", job(max_restarts=2),
     UP3 + [("exit", 1, 1), ("wait", SETTLE)], [(0, 1, 2), (0, 1, 2)], 1, None),
    ("waits for the failures a crash causes", job(max_restarts=2),
     UP3 + [("exit", 1, 1), ("wait", SETTLE - 1)], [(0, 1, 2)], 0, None),
    ("two crashes, two restarts", job(max_restarts=2),
     UP3 + [("exit", 1, 1), ("wait", SETTLE), ("exit", 2, 1), ("wait", SETTLE)],
     [(0, 1, 2)] * 3, 2, None),
    ("restarts used up: the first to fail is left out", job(max_restarts=1),
     UP3 + [("exit", 1, 1), ("wait", SETTLE), ("exit", 2, 1), ("wait", SETTLE)],
     [(0, 1, 2), (0, 1, 2), (0, 1)], 1, None),
    ("no restarts: a crash shrinks the job", job(),
     UP3 + [("exit", 2, -9), ("wait", SETTLE)], [(0, 1, 2), (0, 1)], 0, None),
    ("the first of several failures is the one left out", job(),
     UP3 + [("exit", 1, 1), ("wait", 1), ("exit", 0, 1), ("exit", 2, 1), ("wait", SETTLE)],
     [(0, 1, 2), (0, 2)], 0, None),
    ("shrinking below min_workers ends the job", job(min_workers=3),
     UP3 + [("exit", 0, 1), ("wait", SETTLE)], [(0, 1, 2)], 0, "fewer than min_workers=3"),
    ("a lost host shrinks the job after the settle time", job(),
     UP3 + [("lost", 2), ("wait", SETTLE)], [(0, 1, 2), (0, 1)], 0, None),
    ("a lost host is not dropped at once", job(),
     UP3 + [("lost", 2), ("wait", SETTLE - 1)], [(0, 1, 2)], 0, None),
    ("a lost host with its worker's exit: the live hosts, no restart counted",
     job(max_restarts=3),
     UP3 + [("lost", 1), ("exit", 0, 1), ("wait", SETTLE)], [(0, 1, 2), (0, 2)], 0, None),
    ("the chief's host lost: host 1 leads and is the chief", job(),
     UP3 + [("lost", 0), ("wait", SETTLE)], [(0, 1, 2), (1, 2)], 0, None),
    ("a preempted host leaves without a restart", job(max_restarts=0),
     UP3 + [("preempted", 2), ("wait", SETTLE)], [(0, 1, 2), (0, 1)], 0, None),
    ("a preemption whose host stays up regroups the same hosts", job(),
     UP3 + [("exit", 1, 42), ("wait", SETTLE)], [(0, 1, 2), (0, 1, 2)], 0, None),
    ("a preempted host still beats while its peers exit 42 first: left out",
     job(max_restarts=0),
     UP3 + [("leaving", 2), ("wait", 2), ("exit", 1, 42), ("exit", 0, 42), ("wait", SETTLE)],
     [(0, 1, 2), (0, 1)], 0, None),
    ("the chief's host preempted, its peers exit first: hosts 1 and 2", job(),
     UP3 + [("leaving", 0), ("exit", 2, 42), ("exit", 1, 42), ("wait", SETTLE)],
     [(0, 1, 2), (1, 2)], 0, None),
    ("no generation while a member that leaves still saves", job(rejoin_after=2),
     UP3 + [("leaving", 1), ("wait", 20)], [(0, 1, 2)], 0, None),
    ("a preempted host comes back under its rank: the job grows", job(rejoin_after=5),
     UP3 + [("preempted", 2), ("wait", SETTLE), ("up", 2), ("wait", 5)],
     [(0, 1, 2), (0, 1), (0, 1, 2)], 0, None),
    ("preempted below min_workers ends the job", job(min_workers=3),
     UP3 + [("preempted", 1), ("wait", SETTLE)], [(0, 1, 2)], 0, "fewer than min_workers=3"),
    ("a lost host comes back: the job grows after rejoin_after", job(rejoin_after=8),
     UP3 + [("lost", 2), ("wait", SETTLE), ("up", 2), ("wait", 8)],
     [(0, 1, 2), (0, 1), (0, 1, 2)], 0, None),
    ("a returning host waits for rejoin_after", job(rejoin_after=30),
     UP3 + [("lost", 2), ("wait", SETTLE), ("up", 2), ("wait", 10)],
     [(0, 1, 2), (0, 1)], 0, None),
    ("a late host joins a running job", job(min_workers=2, rejoin_after=5),
     [("up", 0, 1), ("wait", 5), ("wait", 3), ("up", 2), ("wait", 5)],
     [(0, 1), (0, 1, 2)], 0, None),
    ("shrink to one, grow back to three", job(rejoin_after=5),
     UP3 + [("exit", 1, 1), ("lost", 1), ("wait", SETTLE), ("lost", 2), ("wait", SETTLE),
            ("up", 1, 2), ("wait", 5)],
     [(0, 1, 2), (0, 2), (0,), (0, 1, 2)], 0, None),
    ("a restart keeps its count through a grow", job(max_restarts=2, rejoin_after=5),
     UP3 + [("exit", 0, 1), ("wait", SETTLE), ("lost", 2), ("wait", SETTLE),
            ("up", 2), ("wait", 5)],
     [(0, 1, 2), (0, 1, 2), (0, 1), (0, 1, 2)], 1, None),
    ("a clean exit is not a failure", job(),
     UP3 + [("exit", 1, 0), ("wait", 20)], [(0, 1, 2)], 0, None),
    ("a hung worker (124) is a failure like any other", job(max_restarts=1),
     UP3 + [("exit", 2, 124), ("wait", SETTLE)], [(0, 1, 2), (0, 1, 2)], 1, None),
    ("the lone survivor loses its host: nobody leads, nothing proposed", job(),
     [("up", 0), ("wait", 10), ("lost", 0), ("wait", 20)], [(0,)], 0, None),
    ("two hosts lost at once: one regroup", job(hosts=4),
     [("up", 0, 1, 2, 3), ("lost", 1, 3), ("wait", SETTLE)], [(0, 1, 2, 3), (0, 2)], 0, None),
    ("hosts lost one after another: the settle clock starts at the first", job(hosts=4),
     [("up", 0, 1, 2, 3), ("lost", 3), ("wait", 3), ("lost", 2), ("wait", SETTLE - 3)],
     [(0, 1, 2, 3), (0, 1)], 0, None),
    ("a host left out after its crash rejoins after rejoin_after", job(rejoin_after=5),
     UP3 + [("exit", 2, 1), ("wait", SETTLE), ("wait", 5)], [(0, 1, 2), (0, 1), (0, 1, 2)], 0,
     None),
    ("a crash during the settle of a lost host: the live hosts", job(max_restarts=5),
     UP3 + [("lost", 2), ("wait", 2), ("exit", 1, 1), ("wait", SETTLE)],
     [(0, 1, 2), (0, 1)], 0, None),
]


@pytest.mark.parametrize(
    "name, terms, events, members, restarts, failure", CASES, ids=[c[0] for c in CASES]
)
def test_event_sequence(name, terms, events, members, restarts, failure):
    rz = Rendezvous(terms)
    for event in events:
        rz.play(event)
    assert [tuple(g["members"]) for g in rz.generations] == members, [
        (g["members"], g["reason"]) for g in rz.generations]
    if rz.generations:
        assert rz.generations[-1]["restarts"] == restarts
    if failure is None:
        assert rz.failed is None, rz.failed
    else:
        assert failure in (rz.failed or ""), rz.failed


def test_a_grow_asks_the_workers_to_save_first_and_nothing_else_does():
    rz = Rendezvous(job(rejoin_after=5))
    for event in UP3 + [("exit", 1, 1), ("lost", 1), ("wait", SETTLE), ("lost", 2),
                        ("wait", SETTLE), ("up", 1, 2), ("wait", 5)]:
        rz.play(event)
    assert [g["save_first"] for g in rz.generations] == [False, False, False, True]
    assert [g["reason"] for g in rz.generations] == [
        "3 of 3 hosts are up",
        f"host(s) [1] lost (no heartbeat for {policy.STALE_SECONDS:g}s; host 1's worker "
        "exited with code 1)",
        f"host(s) [2] lost (no heartbeat for {policy.STALE_SECONDS:g}s)",
        "host(s) [1, 2] are up again (5s after generation 3 began)",
    ]


def test_the_reasons_say_what_happened():
    rz = Rendezvous(job(max_restarts=1))
    for event in UP3 + [("exit", 1, -9), ("wait", SETTLE), ("leaving", 2), ("exit", 0, 42),
                        ("wait", 1), ("preempted", 2), ("wait", SETTLE),
                        ("exit", 0, 3), ("wait", SETTLE)]:
        rz.play(event)
    assert [g["reason"] for g in rz.generations[1:]] == [
        "host 1's worker was killed by SIGKILL (restart 1/1)",
        "host(s) [2] left, preempted (the workers saved a backup and exited 42)",
        "host 0's worker exited with code 3 and the restarts are used up (1/1)",
    ]
    assert rz.generations[-1]["members"] == [1]


def play_local(terms, elastic, stops):
    """A local job: each stop is ("fail", code) or ("grow", code); returns
    the group sizes it ran, its restarts, and "failed" or "running"."""
    size, restarts, sizes = terms.hosts, 0, [terms.hosts]
    for kind, code in stops:
        if kind == "grow":
            assert policy.resize_after(terms, size, elastic) is not None
            decision = policy.after_a_local_stop_to_grow(terms, restarts, code, "why")
        else:
            decision = policy.after_a_local_failure(terms, size, restarts, code, "why",
                                                    elastic)
        if decision.action == "fail":
            return sizes, restarts, "failed"
        assert decision.action in ("restart", "resize")
        assert (decision.size == size) == (decision.action == "restart")
        size, restarts = decision.size, decision.restarts
        sizes.append(size)
    return sizes, restarts, "running"


# (name, job, elastic, group stops, sizes it ran, restarts, how it ends)
LOCAL_CASES = [
    ("no restarts: a crash ends a fixed job", job(4, max_restarts=0), False,
     [("fail", 1)], [4], 0, "failed"),
    ("a crash restarts a fixed job while restarts are left", job(4, max_restarts=2), False,
     [("fail", 1), ("fail", -9)], [4, 4, 4], 2, "running"),
    ("restarts used up: a fixed job fails", job(4, max_restarts=2), False,
     [("fail", 1), ("fail", 1), ("fail", 1)], [4, 4, 4], 2, "failed"),
    ("a preemption of a fixed job is a restart", job(2, max_restarts=1), False,
     [("fail", 42)], [2, 2], 1, "running"),
    ("a preemption shrinks an elastic job without a restart", job(4, min_workers=2), True,
     [("fail", 42), ("fail", 42)], [4, 3, 2], 0, "running"),
    ("preempted at min_workers with no restarts left: the end", job(2, min_workers=2), True,
     [("fail", 42)], [2], 0, "failed"),
    ("an elastic job restarts first, then shrinks", job(3, min_workers=1, max_restarts=1),
     True, [("fail", 1), ("fail", 1), ("fail", 1)], [3, 3, 2, 1], 1, "running"),
    ("an elastic job ends at min_workers", job(3, min_workers=2), True,
     [("fail", 1), ("fail", 1)], [3, 2], 0, "failed"),
    ("a shrunk group grows back to full size", job(4, min_workers=2, max_restarts=0), True,
     [("fail", 42), ("grow", 42)], [4, 3, 4], 0, "running"),
    ("a grow keeps the restart count", job(3, min_workers=1, max_restarts=1), True,
     [("fail", 1), ("fail", 1), ("grow", 0), ("fail", 1)], [3, 3, 2, 3, 2], 1, "running"),
    ("a hang (124) is a failure like any other", job(2, max_restarts=1), False,
     [("fail", 124), ("fail", 124)], [2, 2], 1, "failed"),
]


@pytest.mark.parametrize("name, terms, elastic, stops, sizes, restarts, end", LOCAL_CASES,
                         ids=[c[0] for c in LOCAL_CASES])
def test_local_job_sequence(name, terms, elastic, stops, sizes, restarts, end):
    assert play_local(terms, elastic, stops) == (sizes, restarts, end)


def test_a_local_group_at_full_size_never_stops_to_grow():
    terms = job(3, min_workers=1, rejoin_after=7)
    assert policy.resize_after(terms, 3, True) is None
    assert policy.resize_after(terms, 2, True) == 7
    assert policy.resize_after(terms, 2, False) is None


def test_the_local_reasons_say_what_happened():
    terms = job(2, min_workers=1, max_restarts=1, rejoin_after=5)
    assert policy.after_a_local_failure(terms, 2, 1, 1, "worker 1 exited with code 1",
                                        True).reason == (
        "worker 1 exited with code 1 and the restarts are used up (1/1)")
    assert policy.after_a_local_failure(terms, 1, 1, 1, "worker 0 exited with code 1",
                                        True).reason == (
        "worker 0 exited with code 1 (after 1 restart(s)) (on 1, the fewest workers allowed)")
    assert policy.after_a_local_stop_to_grow(terms, 0, 42, "").reason == (
        "it trained 5s on fewer than 2 workers (the group saved and exited to grow)")


def test_the_policy_needs_neither_tensorflow_nor_keras():
    import subprocess
    import sys

    # As in the `keras-dist` command's process (no TensorFlow start-up).
    code = ("import sys; sys.argv = ['keras-dist']; "
            "import keras_dist.launchers.elastic_policy; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
