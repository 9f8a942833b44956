"""The rendezvous of elastic multi-host jobs, in one process: the directory
backend, and the etcd backend on a real etcd started here."""

import os
import time

import pytest

from keras_dist.launchers import rendezvous
from keras_dist.launchers.rendezvous import DirectoryRendezvous as Rendezvous


def test_each_generation_is_written_once(tmp_path):
    first, second = Rendezvous(str(tmp_path), 0, 3), Rendezvous(str(tmp_path), 1, 3)
    assert first.latest() == (0, None)
    assert first.propose(1, [0, 1, 2], "3 of 3 hosts are up", 0)
    assert not second.propose(1, [1, 2], "a late proposal", 0)
    number, generation = second.latest()
    assert number == 1 and generation["members"] == [0, 1, 2]
    assert second.propose(2, [1, 2], "host(s) [0] lost", 0)
    assert first.latest()[1]["members"] == [1, 2]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_a_host_is_alive_while_it_beats_and_gone_when_it_leaves(tmp_path, monkeypatch):
    monkeypatch.setattr(rendezvous, "HEARTBEAT_SECONDS", 0.05)
    hosts = [Rendezvous(str(tmp_path), rank, 3) for rank in range(3)]
    for host in hosts[:2]:
        host.start_beating()
    try:
        assert hosts[2].alive() == [0, 1]
        # A host that stops beating (its machine is gone) goes stale.
        hosts[1]._stop.set()
        hosts[1]._beating.join()
        old = time.time() - rendezvous.STALE_SECONDS - 1
        os.utime(tmp_path / "alive-1", (old, old))
        assert hosts[2].alive() == [0]
        # A host that leaves (interrupted) is gone at once.
        hosts[0].stop_beating()
        assert hosts[2].alive() == []
    finally:
        for host in hosts:
            host.stop_beating()


def test_exits_are_recorded_once_per_host_and_generation(tmp_path):
    host = Rendezvous(str(tmp_path), 2, 3)
    host.record_exit(4, 42)
    host.record_exit(4, 1)  # a second report of the same exit is ignored
    assert {r: e["code"] for r, e in host.exits(4).items()} == {2: 42}
    assert host.exits(3) == {}


@pytest.mark.parametrize("ended", ["done", "failed"])
def test_a_directory_of_a_job_that_ended_is_refused(tmp_path, ended):
    (tmp_path / ended).write_text("{}")
    with pytest.raises(ValueError, match=f"holds a job that ended \\(`{ended}`\\)"):
        Rendezvous(str(tmp_path), 0, 2)


# -- the etcd backend, on a real etcd ------------------------------------------


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    from etcd_server import running_etcd

    with running_etcd(str(tmp_path_factory.mktemp("etcd") / "data")) as address:
        yield address


def test_etcd_records_are_written_once_even_when_hosts_race(etcd):
    import threading

    from keras_dist.launchers.rendezvous import EtcdRendezvous

    url = f"etcd://{etcd}/race"
    hosts = [EtcdRendezvous(url, rank, 8) for rank in range(8)]
    won = [None] * 8

    def propose(rank):
        won[rank] = hosts[rank].propose(1, [rank], f"host {rank}", 0)

    threads = [threading.Thread(target=propose, args=(r,)) for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert won.count(True) == 1
    winner = won.index(True)
    assert all(h.latest() == (1, hosts[0].read("generation-1.json")) for h in hosts)
    assert hosts[3].latest()[1]["members"] == [winner]
    hosts[2].record_exit(1, 42)
    hosts[2].record_exit(1, 1)  # once per host and generation
    assert {r: e["code"] for r, e in hosts[0].exits(1).items()} == {2: 42}


def test_an_etcd_heartbeat_is_a_lease_that_runs_out(etcd, monkeypatch):
    import time

    from keras_dist.launchers import rendezvous
    from keras_dist.launchers.rendezvous import EtcdRendezvous

    monkeypatch.setattr(rendezvous, "STALE_SECONDS", 2.0)
    url = f"etcd://{etcd}/beats"
    a, b = EtcdRendezvous(url, 0, 2), EtcdRendezvous(url, 1, 2)
    assert b.alive() == []
    a._beat()
    assert b.alive() == [0]
    b._beat()
    assert a.alive() == [0, 1]
    deadline = time.monotonic() + 10
    while 0 in b.alive():  # host 0 stops renewing (its launcher died)
        b._beat()
        assert time.monotonic() < deadline, "a lease that is not renewed must run out"
        time.sleep(0.2)
    assert b.alive() == [1]
    b._unbeat()  # leaving: gone at once, not after its lease
    assert a.alive() == []


def test_an_etcd_prefix_of_a_job_that_ended_is_refused(etcd):
    from keras_dist.launchers.rendezvous import EtcdRendezvous

    EtcdRendezvous(f"etcd://{etcd}/ended", 0, 1).finish("done", {"code": 0})
    with pytest.raises(ValueError, match=r"holds a job that ended \(`done`\)"):
        EtcdRendezvous(f"etcd://{etcd}/ended", 0, 1)
    EtcdRendezvous(f"etcd://{etcd}/ended-not", 0, 1)  # a prefix is not a key prefix match


@pytest.mark.parametrize("url", ["etcd://127.0.0.1/job", "etcd://127.0.0.1:2379",
                                 "etcd://127.0.0.1:2379/", "http://127.0.0.1:2379/job",
                                 "etcd://127.0.0.1:x/job"])
def test_a_malformed_etcd_address_is_refused(url):
    from keras_dist.launchers.rendezvous import EtcdRendezvous

    with pytest.raises(ValueError, match=r"etcd://host:port/prefix"):
        EtcdRendezvous(url, 0, 1)


def test_no_etcd_at_the_address_is_said_before_any_work():
    from keras_dist._cluster import loopback_ports
    from keras_dist.launchers.rendezvous import EtcdRendezvous

    (port,) = loopback_ports(1)
    with pytest.raises(ValueError, match=rf"no etcd answers at http://127.0.0.1:{port}"):
        EtcdRendezvous(f"etcd://127.0.0.1:{port}/job", 0, 1)
