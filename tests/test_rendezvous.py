"""The rendezvous directory of elastic multi-host jobs, in one process."""

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
