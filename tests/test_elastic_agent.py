"""The elastic agent (`ElasticHost`) end to end, without TensorFlow: its
hosts are threads of this process sharing a `MemoryRendezvous`, its workers
are small Python processes that follow a script (exit with a code, or run
until told to stop and exit 42 as a worker whose BackupAndRestore saved).

The jobs of a lost, a returning and a preempted host also run on a real
etcd (`EtcdRendezvous`). The same agent runs multi-host jobs over a
`DirectoryRendezvous`
(tests/multi_worker/test_elastic_jobs.py: real workers, real TensorFlow);
the rules it applies are tested event by event in test_elastic_policy.py.
Here the clock is shortened (heartbeats every 0.05 s, stale after 1 s).
"""

import json
import re
import signal
import sys
import threading

import pytest

from keras_dist import _liveness
from keras_dist.launchers import elastic_policy, rendezvous
from keras_dist.launchers.rendezvous import ElasticHost, EtcdRendezvous, MemoryRendezvous


WORKER = r'''
import json, os, signal, sys, time
plan_file, log_file = sys.argv[1], sys.argv[2]
task = json.loads(os.environ["TF_CONFIG"])
cluster, index = task["cluster"]["worker"], task["task"]["index"]
host = int(cluster[index].rsplit(":", 1)[1]) - 20000
with open(log_file, "a") as f:  # one line per start: host, index, size
    f.write(json.dumps([host, index, len(cluster)]) + "\n")
starts = sum(1 for line in open(log_file) if json.loads(line)[0] == host)
actions = json.load(open(plan_file)).get(str(host), [])
action = actions[starts - 1] if starts <= len(actions) else "finish"
signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))  # saved, then exits 42
flag = os.path.join(os.path.dirname(plan_file), "preempted")
if action == "slow-save":  # preempted: its peers save with it, exit 42 first
    def save_slowly(*_):
        open(flag, "w").close()
        time.sleep(4.0)
        sys.exit(42)
    signal.signal(signal.SIGTERM, save_slowly)
if action in ("run", "slow-save", "save-with-peer"):
    while not (action == "save-with-peer" and os.path.exists(flag)):
        time.sleep(0.05)
    sys.exit(42)
time.sleep(0.3)
sys.exit(0 if action == "finish" else int(action))
'''


JOBS = []


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd on 127.0.0.1 (each job its own key prefix)."""
    from etcd_server import running_etcd

    with running_etcd(str(tmp_path_factory.mktemp("etcd") / "data")) as address:
        yield address


@pytest.fixture(params=["memory", "etcd"])
def backend(request):
    """The jobs of a lost, a returning and a preempted host run on both the
    in-process store and a real etcd."""
    return None if request.param == "memory" else request.getfixturevalue("etcd")


@pytest.fixture(autouse=True)
def short_clock(monkeypatch):
    """The shortened clock; afterwards, any worker a failed test left
    running is stopped."""
    monkeypatch.setattr(rendezvous, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(rendezvous, "STALE_SECONDS", 1.0)
    monkeypatch.setattr(elastic_policy, "STALE_SECONDS", 1.0)
    monkeypatch.setattr(elastic_policy, "SETTLE_SECONDS", 1.5)
    yield
    while JOBS:
        for agent in JOBS.pop().agents:
            group = agent.group
            if group is not None:
                group.stop(signal.SIGKILL)


class Job:
    """`hosts` agents in threads; `plan`: host rank -> the action of each
    start of its worker ("run", an exit code, default "finish")."""

    def __init__(self, tmp_path, hosts, plan, backend=None, **terms):
        """`backend`: None (a `MemoryRendezvous`) or an etcd's host:port."""
        self.plan_file, self.log_file = tmp_path / "plan.json", tmp_path / "starts.log"
        self.plan_file.write_text(json.dumps({str(h): a for h, a in plan.items()}))
        self.log_file.write_text("")
        (tmp_path / "worker.py").write_text(WORKER)
        command = [str(tmp_path / "worker.py"), str(self.plan_file), str(self.log_file)]
        addresses = [f"127.0.0.1:{20000 + rank}" for rank in range(hosts)]
        self.store = MemoryRendezvous.Store()
        self.interrupts = [[] for _ in range(hosts)]

        def store(rank):
            if backend is None:
                return MemoryRendezvous(self.store, rank, hosts)
            return EtcdRendezvous(f"etcd://{backend}/{tmp_path.name}", rank, hosts)

        self.agents = [
            ElasticHost(command, addresses, rank, store(rank),
                        min_workers=terms.get("min_workers", 1),
                        rejoin_after=terms.get("rejoin_after", 60.0),
                        max_restarts=terms.get("max_restarts", 0), log_dir=None,
                        grace_period=2.0, verbose=False,
                        timeouts=_liveness.Timeouts(start=None, hang=None))
            for rank in range(hosts)
        ]
        self.codes = [None] * hosts
        self.threads = [threading.Thread(target=self._run, args=(rank,), daemon=True)
                        for rank in range(hosts)]
        JOBS.append(self)

    def _run(self, rank):
        self.codes[rank] = self.agents[rank].run(self.interrupts[rank])

    def start(self, ranks=None):
        for rank in ranks if ranks is not None else range(len(self.threads)):
            self.threads[rank].start()

    def wait(self, timeout=60.0):
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "an agent did not finish"
        return self.codes

    def generations(self):
        number, _ = self.agents[0].rz.latest()
        return [self.agents[0].rz.read(f"generation-{n}.json") for n in range(1, number + 1)]

    def members(self):
        return [g["members"] for g in self.generations()]

    def starts(self):
        return [json.loads(line) for line in self.log_file.read_text().splitlines()]


def test_every_host_up_one_generation_every_worker_finishes(tmp_path):
    job = Job(tmp_path, 3, {})
    job.start()
    assert job.wait() == [0, 0, 0]
    assert job.members() == [[0, 1, 2]]
    assert sorted(job.starts()) == [[0, 0, 3], [1, 1, 3], [2, 2, 3]]
    assert job.agents[0].rz.read("done") is not None


def test_a_crash_restarts_the_same_hosts_and_counts_the_restart(tmp_path):
    job = Job(tmp_path, 3, {1: [3], 0: ["run"], 2: ["run"]}, max_restarts=1)
    job.start()
    assert job.wait() == [0, 0, 0]
    assert job.members() == [[0, 1, 2], [0, 1, 2]]
    assert [g["restarts"] for g in job.generations()] == [0, 1]
    assert "host 1's worker exited with code 3 (restart 1/1)" == job.generations()[1]["reason"]
    assert len(job.starts()) == 6


def test_restarts_used_up_the_failing_host_is_left_out_then_rejoins(tmp_path, backend):
    job = Job(tmp_path, 3, {2: [1], 0: ["run", "run"], 1: ["run", "run"]}, backend,
              max_restarts=0, rejoin_after=1.5)
    job.start()
    assert job.wait() == [0, 0, 0]
    generations = job.generations()
    assert job.members() == [[0, 1, 2], [0, 1], [0, 1, 2]]
    assert generations[1]["reason"] == (
        "host 2's worker exited with code 1 and the restarts are used up (0/0)")
    assert [g["save_first"] for g in generations] == [False, False, True]
    # The left-out host's worker is started again only in generation 3,
    # where it is task 2 again; in generation 2 the survivors are 0 and 1.
    assert [s for s in job.starts() if s[0] == 2] == [[2, 2, 3], [2, 2, 3]]
    assert sorted(s for s in job.starts() if s[2] == 2) == [[0, 0, 2], [1, 1, 2]]


def test_an_interrupted_host_leaves_and_the_others_go_on(tmp_path, backend):
    job = Job(tmp_path, 3, {0: ["run", "finish"], 1: ["run"], 2: ["run", "finish"]},
              backend, min_workers=2)
    job.start()
    while len(job.starts()) < 3:
        threading.Event().wait(0.05)
    job.interrupts[1].append(signal.SIGTERM)
    assert job.wait() == [0, 128 + signal.SIGTERM, 0]
    assert job.members() == [[0, 1, 2], [0, 2]]
    assert job.generations()[1]["reason"] == (
        "host(s) [1] left, preempted (the workers saved a backup and exited 42)")
    # Host 2 is task 1 of the two-worker generation: the cluster is renumbered.
    assert sorted(s for s in job.starts() if s[2] == 2) == [[0, 0, 2], [2, 1, 2]]


def test_a_preempted_host_that_saves_slowly_is_not_in_the_next_generation(tmp_path, backend):
    """The preempted host's worker saves until its launcher's 2 s grace
    period ends (longer than a heartbeat takes to go stale plus the leader's
    settle time) while its peers' workers exit 42 at once: its launcher still
    beats, yet the next generation is hosts 0 and 1, made once, from the
    preemption (before: hosts 0, 1 and 2 again, whose start then failed)."""
    job = Job(tmp_path, 3, {0: ["save-with-peer", "finish"], 1: ["save-with-peer", "finish"],
                            2: ["slow-save"]}, backend, min_workers=2)
    job.start()
    while len(job.starts()) < 3:
        threading.Event().wait(0.05)
    job.interrupts[2].append(signal.SIGTERM)
    assert job.wait() == [0, 0, 128 + signal.SIGTERM]
    assert job.members() == [[0, 1, 2], [0, 1]]
    assert job.generations()[1]["reason"] == (
        "host(s) [2] left, preempted (the workers saved a backup and exited 42)")


def test_the_preempted_chief_host_no_longer_leads(tmp_path):
    """Host 0 (the leader) is preempted and saves slowly: host 1 leads the
    next generation while host 0 still beats."""
    job = Job(tmp_path, 3, {0: ["slow-save"], 1: ["save-with-peer", "finish"],
                            2: ["save-with-peer", "finish"]}, min_workers=2)
    job.start()
    while len(job.starts()) < 3:
        threading.Event().wait(0.05)
    job.interrupts[0].append(signal.SIGTERM)
    assert job.wait() == [128 + signal.SIGTERM, 0, 0]
    assert job.members() == [[0, 1, 2], [1, 2]]
    # Made while host 0's worker was still saving.
    assert job.generations()[1]["time"] < job.agents[0].rz.read("exit-1-0.json")["time"]


def test_too_few_hosts_left_fails_the_job_on_every_host(tmp_path):
    job = Job(tmp_path, 2, {1: [5], 0: ["run"]}, min_workers=2)
    job.start()
    assert job.wait() == [5, 5]
    assert job.members() == [[0, 1]]
    failed = job.agents[0].rz.read("failed")
    assert "fewer than min_workers=2" in failed["reason"] and failed["code"] == 5


def test_a_late_host_waits_then_joins_a_running_job(tmp_path, backend):
    job = Job(tmp_path, 3, {0: ["run", "finish"], 1: ["run", "finish"]}, backend,
              min_workers=2, rejoin_after=0.8)
    job.start([0, 1])
    while len(job.starts()) < 2:
        threading.Event().wait(0.05)
    job.start([2])
    assert job.wait() == [0, 0, 0]
    assert job.members() == [[0, 1], [0, 1, 2]]
    assert job.generations()[1]["save_first"] is True


def test_the_backends_agree(tmp_path, etcd):
    """The same calls give the same records on every backend."""
    stores = [MemoryRendezvous(MemoryRendezvous.Store(), 0, 2),
              rendezvous.DirectoryRendezvous(str(tmp_path / "rz"), 0, 2),
              EtcdRendezvous(f"etcd://{etcd}/agree", 0, 2)]
    for rz in stores:
        assert rz.latest() == (0, None)
        assert rz.propose(1, [0, 1], "2 of 2 hosts are up", 0)
        assert not rz.propose(1, [1], "late", 0)
        rz.record_exit(1, 42)
        rz.record_exit(1, 1)
        rz.announce_leaving()
        assert rz.leaving() == (0,)
        rz.start_beating()  # a host that left and comes back under its rank
        assert rz.leaving() == ()
    try:
        assert [rz.alive() for rz in stores] == [[0]] * 3
        assert [rz.latest()[1]["members"] for rz in stores] == [[0, 1]] * 3
        assert [{r: e["code"] for r, e in rz.exits(1).items()} for rz in stores] == [
            {0: 42}] * 3
    finally:
        for rz in stores:
            rz.stop_beating()
    assert [rz.alive() for rz in stores] == [[]] * 3


def test_a_backend_must_implement_every_primitive():
    class Partial(rendezvous.Rendezvous):
        def read(self, name):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial(0, 1)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_first_generations_wait_for_hosts_is_said_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(rendezvous, "WAIT_NOTICE_SECONDS", 0.5)
    job = Job(tmp_path, 3, {0: ["finish"], 1: ["finish"]}, min_workers=2, rejoin_after=2.0)
    job.start([0, 1])  # host 2 never comes: the job starts on 2 after rejoin_after
    while not job.generations():
        threading.Event().wait(0.05)
    err = capfd.readouterr().err
    said = re.findall(r"waited \d+s for hosts \[2\] to reach the rendezvous \(2 of 3 up\); "
                      r"the job starts without them after --rejoin-after 2s if at least "
                      r"--min-workers 2 are up", err)
    assert len(said) == 1, err
    assert job.members()[0] == [0, 1]
