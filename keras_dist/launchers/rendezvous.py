"""Elastic multi-host jobs: one launcher per host, agreeing through a
directory (or an etcd key prefix: `EtcdRendezvous`).

`keras-dist launch --hosts h0:p,h1:p,h2:p --rank I --min-workers K
--rendezvous DIR` runs on every host. DIR is on storage every host sees
(the same kind of shared storage the job's backups need). Each launcher
keeps a heartbeat file there (`alive-<rank>`, rewritten every
`HEARTBEAT_SECONDS`); a host whose heartbeat is older than `STALE_SECONDS`
is lost.

The job runs in generations. A generation is a file `generation-<g>.json`
naming its members (host ranks, ascending) and why it was made; it is
created with an exclusive link, so each number is written once, by
whichever launcher gets there first. A member starts its worker with the
cluster of the members' `--hosts` addresses, in rank order: the lowest
surviving rank is task 0, the chief, which writes the backups. A launcher
that is not a member (a host that came back) waits for a generation that
includes it.

A launcher that gets SIGTERM (its host is preempted) first announces that
it leaves (`leaving-<rank>`), then forwards the signal to its worker, which
saves with its peers and exits 42; it beats until then, but no later
generation counts it (and it no longer leads).

The leader (the lowest-ranked live launcher that stays) makes the next
generation when:
- none exists yet: every host is up, or `rejoin_after` passed with at least
  K up;
- a member's worker failed: after a short wait (so that the failures its
  failure caused, and lost heartbeats, are in), the live hosts; when no
  host was lost and the worker was not preempted, this counts as a restart,
  and once the restarts are used up the host whose worker failed first is
  left out;
- a member's host was lost: the live hosts (while a member that leaves still
  saves, the leader waits for its exit);
- a live host is not a member and the generation is `rejoin_after` old:
  every live host (the workers save and exit 42, the job grows).
Members stop their worker (SIGTERM: it saves within two steps) when a newer
generation appears, then start their part of it. With fewer than K live
hosts the job fails (`failed` file); when a worker finishes its training
the job is done (`done` file) and every launcher exits 0.
"""

from __future__ import annotations

import abc
import base64
import json
import math
import os
import signal
import tempfile
import threading
import time
import urllib.parse
import urllib.request

from keras_dist import _cluster
from keras_dist.launchers import elastic_policy as policy
from keras_dist.launchers.supervisor import (
    HANG_EXIT_CODE,
    Group,
    describe_exit,
    exit_status,
    say,
    signal_name,
)

HEARTBEAT_SECONDS = 0.5
WAIT_NOTICE_SECONDS = 10.0  # a longer wait for the first generation is said once
STALE_SECONDS = policy.STALE_SECONDS


class Rendezvous(abc.ABC):
    """What the launchers of one elastic job share: heartbeats, records
    written once (generations, exits, the job's end) and reads of them.

    The agent (`ElasticHost`) only calls the methods below; a backend
    implements seven primitives: `_write_once`, `read`, `_names`, `_remove`,
    `_beat`, `_unbeat` and `_beat_age`. `DirectoryRendezvous` keeps them in a
    directory on shared storage (multi-host jobs); `MemoryRendezvous` in
    one process (the agent's tests, hosts as threads).
    """

    def __init__(self, rank: int, num_hosts: int):
        self.rank = rank
        self.num_hosts = num_hosts
        self._stop = threading.Event()
        self._beating = None

    # -- the primitives of a backend ----------------------------------------

    @abc.abstractmethod
    def _write_once(self, name: str, content: dict) -> bool:
        """Creates record `name` with `content` unless it exists; True if
        this call created it (exactly one of several racing callers)."""

    @abc.abstractmethod
    def read(self, name: str) -> dict | None:
        """Record `name`, or None if it does not exist (yet)."""

    @abc.abstractmethod
    def _names(self) -> list[str]:
        """The names of every record."""

    @abc.abstractmethod
    def _remove(self, name: str) -> None:
        """Deletes record `name` if it exists."""

    @abc.abstractmethod
    def _beat(self) -> None:
        """This host is alive now."""

    @abc.abstractmethod
    def _unbeat(self) -> None:
        """This host left (its heartbeat is gone at once)."""

    @abc.abstractmethod
    def _beat_age(self, rank: int) -> float | None:
        """Seconds since host `rank` last beat (None: it never did or left)."""

    # -- heartbeats --------------------------------------------------------

    def start_beating(self) -> None:
        # A host that left (preempted) and comes back under its rank joins
        # again: its earlier launcher's announcement no longer holds.
        self._remove(f"leaving-{self.rank}")
        self._beat()
        self._beating = threading.Thread(target=self._beat_forever, daemon=True)
        self._beating.start()

    def _beat_forever(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            self._beat()

    def stop_beating(self) -> None:
        """Leaves the job: the others see this host as lost at once."""
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
        self._unbeat()

    def announce_leaving(self) -> None:
        """This host leaves the job once its worker has stopped: no later
        generation counts it, while it still beats as its worker saves."""
        self._write_once(f"leaving-{self.rank}", {"time": time.time()})

    def leaving(self) -> tuple[int, ...]:
        """The hosts that announced they leave."""
        names = set(self._names())
        return tuple(r for r in range(self.num_hosts) if f"leaving-{r}" in names)

    def alive(self) -> list[int]:
        ranks = []
        for rank in range(self.num_hosts):
            age = self._beat_age(rank)
            if age is not None and age < STALE_SECONDS:
                ranks.append(rank)
        return ranks

    # -- generations -------------------------------------------------------

    def latest(self) -> tuple[int, dict | None]:
        numbers = [
            int(name.split("-")[1].split(".")[0]) for name in self._names()
            if name.startswith("generation-") and name.endswith(".json")
        ]
        if not numbers:
            return 0, None
        number = max(numbers)
        return number, self.read(f"generation-{number}.json")

    def propose(self, number: int, members: list[int], reason: str, restarts: int,
                save_first: bool = False) -> bool:
        """`save_first`: the running workers are healthy; they get time to
        save within two steps (a grow) instead of a grace period."""
        made = self._write_once(f"generation-{number}.json", {
            "members": members, "reason": reason, "restarts": restarts,
            "save_first": save_first, "time": time.time(),
        })
        if made:
            say(f"generation {number}: hosts {members} because {reason}")
        return made

    def record_exit(self, number: int, code: int) -> None:
        self._write_once(f"exit-{number}-{self.rank}.json",
                         {"code": code, "time": time.time()})

    def exits(self, number: int) -> dict[int, dict]:
        found = {}
        for rank in range(self.num_hosts):
            record = self.read(f"exit-{number}-{rank}.json")
            if record is not None:
                found[rank] = record
        return found

    def finish(self, outcome: str, content: dict) -> None:
        self._write_once(outcome, content)


class DirectoryRendezvous(Rendezvous):
    """The rendezvous as files of a directory on shared storage: a record
    is created with an exclusive link, a heartbeat is a file's mtime."""

    def __init__(self, directory: str, rank: int, num_hosts: int):
        for ended in ("done", "failed"):
            if os.path.exists(os.path.join(directory, ended)):
                raise ValueError(
                    f"Invalid value for argument `rendezvous`: {directory!r} "
                    f"holds a job that ended (`{ended}`). Give each job its own "
                    "rendezvous directory (or remove this one)."
                )
        os.makedirs(directory, exist_ok=True)
        super().__init__(rank, num_hosts)
        self.directory = directory

    def _file(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write_once(self, name: str, content: dict) -> bool:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        try:
            os.link(tmp, self._file(name))
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def read(self, name: str) -> dict | None:
        try:
            with open(self._file(name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _names(self) -> list[str]:
        return os.listdir(self.directory)

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self._file(name))
        except FileNotFoundError:
            pass

    def _beat(self) -> None:
        path = self._file(f"alive-{self.rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)

    def _unbeat(self) -> None:
        try:
            os.unlink(self._file(f"alive-{self.rank}"))
        except FileNotFoundError:
            pass

    def _beat_age(self, rank: int) -> float | None:
        try:
            return time.time() - os.path.getmtime(self._file(f"alive-{rank}"))
        except FileNotFoundError:
            return None


class EtcdRendezvous(Rendezvous):
    """The rendezvous in etcd (v3), for clusters that already run it.

    `etcd://host:port/prefix`: every record is the key `prefix/name`, made
    once by a transaction that compares its creation revision with 0 (one
    of several racing launchers wins). A heartbeat is the key
    `prefix/alive-<rank>`, written again at each beat and attached to a
    lease of `STALE_SECONDS` that each beat renews; its age is how long
    ago the reader saw the key change, on the reader's own clock (no two
    hosts' clocks are compared). A launcher that dies stops renewing: its
    key goes when the lease runs out. Spoken over etcd's JSON gateway (`/v3/...`), with no client
    library.
    """

    def __init__(self, url: str, rank: int, num_hosts: int, timeout: float = 10.0):
        self.endpoint, self.prefix = parse_etcd_url(url)
        self.timeout = timeout
        super().__init__(rank, num_hosts)
        self._lease = None
        self._beats = 0
        self._seen = {}  # rank -> (its heartbeat key's revision, when first seen)
        try:
            ended = [e for e in ("done", "failed") if self.read(e) is not None]
        except OSError as e:
            raise ValueError(
                f"Invalid value for argument `rendezvous`: no etcd answers at "
                f"{self.endpoint} ({e}). Received: rendezvous={url!r}. Start "
                "etcd there, or give the address of one this host reaches."
            ) from None
        if ended:
            raise ValueError(
                f"Invalid value for argument `rendezvous`: {url!r} holds a job "
                f"that ended (`{ended[0]}`). Give each job its own prefix (or "
                "delete its keys: etcdctl del --prefix)."
            )

    def _call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.endpoint}/v3/{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def _key(self, name: str) -> str:
        return _b64(f"{self.prefix}/{name}")

    def _write_once(self, name: str, content: dict) -> bool:
        key = self._key(name)
        answer = self._call("kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": _b64(json.dumps(content))}}],
        })
        return bool(answer.get("succeeded"))

    def _range(self, name: str) -> dict | None:
        kvs = self._call("kv/range", {"key": self._key(name)}).get("kvs", [])
        return kvs[0] if kvs else None

    def read(self, name: str) -> dict | None:
        try:
            kv = self._range(name)
            return None if kv is None else json.loads(_unb64(kv.get("value", "")))
        except ValueError:
            return None

    def _names(self) -> list[str]:
        start = f"{self.prefix}/"
        end = start[:-1] + chr(ord("/") + 1)  # every key under the prefix
        kvs = self._call("kv/range", {"key": _b64(start), "range_end": _b64(end),
                                      "keys_only": True}).get("kvs", [])
        return [_unb64(kv["key"])[len(start):] for kv in kvs]

    def _remove(self, name: str) -> None:
        self._call("kv/deleterange", {"key": self._key(name)})

    def _beat(self) -> None:
        if self._lease is not None:
            answer = self._call("lease/keepalive", {"ID": self._lease}).get("result", {})
            if int(answer.get("TTL", 0)) <= 0:
                self._lease = None  # ran out (this host was away): a new one
        if self._lease is None:
            self._lease = self._call(
                "lease/grant", {"TTL": max(2, math.ceil(STALE_SECONDS))})["ID"]
        self._beats += 1  # a new revision of the key: what others see change
        self._call("kv/put", {"key": self._key(f"alive-{self.rank}"),
                              "value": _b64(f"{os.getpid()} {self._beats}"),
                              "lease": self._lease})

    def _unbeat(self) -> None:
        if self._lease is not None:
            self._call("lease/revoke", {"ID": self._lease})  # its key goes with it
            self._lease = None

    def _beat_age(self, rank: int) -> float | None:
        kv = self._range(f"alive-{rank}")
        if kv is None:
            return None
        revision, now = kv.get("mod_revision"), time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != revision:
            # A new beat now; seen first: as old as its lease says (whole
            # seconds: etcd counts a lease's time left in them).
            age = 0.0
            if seen is None and kv.get("lease"):
                left = self._call("lease/timetolive", {"ID": kv["lease"]})
                age = max(0.0, float(int(left.get("grantedTTL", 0))
                                     - int(left.get("TTL", 0)) - 1))
            self._seen[rank] = (revision, now - age)
        return now - self._seen[rank][1]


def parse_etcd_url(url: str) -> tuple[str, str]:
    """(`http://host:port`, `/prefix`) of `etcd://host:port/prefix`.

    Raises:
        ValueError: naming `rendezvous`, for another form.
    """
    parts = urllib.parse.urlsplit(url)
    prefix = parts.path.rstrip("/")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "etcd" or not parts.hostname or port is None or not prefix:
        raise ValueError(
            "Invalid value for argument `rendezvous`. Expected a directory, or "
            "etcd://host:port/prefix (a key prefix of this job's own). "
            f"Received: rendezvous={url!r}."
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}", prefix


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def open_rendezvous(where: str, rank: int, num_hosts: int) -> Rendezvous:
    """The rendezvous `--rendezvous` names: `etcd://host:port/prefix`, or a
    directory on storage every host sees."""
    if where.startswith("etcd:") or "://" in where:
        return EtcdRendezvous(where, rank, num_hosts)  # refuses other schemes
    return DirectoryRendezvous(where, rank, num_hosts)


class MemoryRendezvous(Rendezvous):
    """The rendezvous in this process: the hosts of one job are threads
    that share `store` (a `MemoryRendezvous.Store`)."""

    class Store:
        def __init__(self):
            self.lock = threading.Lock()
            self.records: dict[str, str] = {}
            self.beats: dict[int, float] = {}

    def __init__(self, store: MemoryRendezvous.Store, rank: int, num_hosts: int):
        super().__init__(rank, num_hosts)
        self.store = store

    def _write_once(self, name: str, content: dict) -> bool:
        with self.store.lock:
            if name in self.store.records:
                return False
            self.store.records[name] = json.dumps(content)
            return True

    def read(self, name: str) -> dict | None:
        with self.store.lock:
            record = self.store.records.get(name)
        return None if record is None else json.loads(record)

    def _names(self) -> list[str]:
        with self.store.lock:
            return list(self.store.records)

    def _remove(self, name: str) -> None:
        with self.store.lock:
            self.store.records.pop(name, None)

    def _beat(self) -> None:
        with self.store.lock:
            self.store.beats[self.rank] = time.monotonic()

    def _unbeat(self) -> None:
        with self.store.lock:
            self.store.beats.pop(self.rank, None)

    def _beat_age(self, rank: int) -> float | None:
        with self.store.lock:
            beat = self.store.beats.get(rank)
        return None if beat is None else time.monotonic() - beat


class ElasticHost:
    """This host's launcher in an elastic multi-host job."""

    def __init__(self, command, hosts, rank, rendezvous, *, min_workers, rejoin_after,
                 max_restarts, log_dir, grace_period, verbose, timeouts,
                 worker_env=None):
        """`rendezvous`: a directory on shared storage, `etcd://host:port/prefix`,
        or a `Rendezvous`;
        `worker_env`: variables of this host's worker besides `TF_CONFIG`."""
        self.command = command
        self.worker_env = dict(worker_env or {})
        self.hosts = hosts
        self.rank = rank
        self.rz = (rendezvous if isinstance(rendezvous, Rendezvous)
                   else open_rendezvous(rendezvous, rank, len(hosts)))
        self.job = policy.Job(len(hosts), min_workers, max_restarts, rejoin_after,
                              timeouts.start)
        self.log_dir = log_dir
        self.grace_period = grace_period
        self.verbose = verbose
        self.timeouts = timeouts
        self.started = time.time()
        self.group = None  # this host's worker, when one runs
        self.generation = 0  # the generation of `group` (or last run)
        self._lead_generation = 0  # what `_lost_since` refers to
        self._lost_since = None  # when the leader first saw a member lost
        self._told_wait = False  # the first generation's wait, said once

    def run(self, interrupt) -> int:
        self.rz.start_beating()
        try:
            while True:
                if interrupt:
                    return self._interrupted(interrupt[0])
                status = self._step()
                if status is not None:
                    return status
                time.sleep(0.2)
        finally:
            if self.group is not None:
                self.group.stop()
            self.rz.stop_beating()

    def _interrupted(self, signum: int) -> int:
        name = signal_name(signum)
        say(f"received {name}: asking the worker to save a backup and exit "
            f"(grace period {self.grace_period:g}s); this host leaves the job")
        # Said before the worker saves: the peers' workers save with it and
        # exit 42 first, and the next generation must not count this host.
        self.rz.announce_leaving()
        if self.group is not None:
            self.group.stop(signal.SIGTERM)  # BackupAndRestore saves and exits 42
            # A preempted worker saved and exited 42: say so to the others.
            self.rz.record_exit(self.generation, self.group.workers[0].proc.returncode)
            self.group = None
        return 128 + signum

    def _step(self) -> int | None:
        done = self.rz.read("done")
        failed = self.rz.read("failed")
        number, generation = self.rz.latest()
        if self.group is not None and failed is not None:
            # The job ended below min_workers: a worker still running
            # (waiting on peers that are gone) is stopped, not waited for.
            say(f"job failed: {failed['reason']}; stopping this host's worker")
            self.group.stop()
            self.group = None
        if self.group is not None:
            status = self._supervise(number, generation, done)
            if status is not None:
                return status
        elif done is not None:
            say(f"job finished (generation {done['generation']})")
            return 0
        if failed is not None and self.group is None:
            say(f"job failed: {failed['reason']}")
            return failed["code"]
        if (self.group is None and generation is not None and number > self.generation
                and self.rank in generation["members"]):
            self._start(number, generation["members"])
        leading = [a for a in self.rz.alive() if a not in self.rz.leaving()]
        if done is None and failed is None and leading[:1] == [self.rank]:
            self._lead(number, generation)
        return None

    # -- this host's worker ------------------------------------------------

    def _start(self, number: int, members: list[int]) -> None:
        workers = [self.hosts[m] for m in members]
        index = members.index(self.rank)
        config = _cluster.tf_config(workers, index)
        say(f"generation {number}: starting worker {index} of {len(members)} "
            f"({workers[index]}; chief {workers[0]}): python " + " ".join(self.command))
        self.generation = number
        self.group = Group(self.command,
                           [(f"worker {index}", {"TF_CONFIG": config, **self.worker_env})],
                           self.log_dir, self.grace_period, self.verbose,
                           timeouts=self.timeouts)

    def _supervise(self, number: int, generation: dict, done) -> int | None:
        proc = self.group.workers[0].proc
        code = proc.poll()
        if code is None and number > self.generation:
            save = generation.get("save_first", False)
            say(f"generation {number} replaces {self.generation}: "
                + ("asking the worker to save and exit" if save else "stopping the worker"))
            self.group.stop_to_resize(save)
            self.group = None
            return None
        if code is None:
            hung = self.group.unresponsive()
            if hung is None:
                return None
            self.group.report_hang(*hung)
            self.group.stop()
            code = HANG_EXIT_CODE
        self.group.workers[0].reader.join(timeout=5)
        self.group.stop()
        self.group = None
        if code == 0:
            self.rz.finish("done", {"generation": self.generation, "rank": self.rank})
            say(f"job finished: this host's worker exited with code 0 "
                f"after {time.time() - self.started:.1f}s")
            return 0
        if number > self.generation or done is not None:
            return None  # stopped because of a newer generation, or the end
        say(f"worker {describe_exit(code)} (generation {self.generation})")
        self.rz.record_exit(self.generation, code)
        return None

    # -- leading -----------------------------------------------------------

    def _lead(self, number: int, generation: dict | None) -> None:
        alive, now, leaving = self.rz.alive(), time.time(), self.rz.leaving()
        if generation is None:
            up = [a for a in alive if a not in leaving]
            proposal = policy.first_generation(self.job, up, now - self.started)
            if proposal is None:
                self._tell_wait(up, now - self.started)
            number = 0
        else:
            if number != self._lead_generation:
                self._lead_generation, self._lost_since = number, None
            proposal, self._lost_since = policy.next_generation(
                self.job, number, generation, alive, self.rz.exits(number), now,
                self._lost_since, leaving)
        if proposal is not None:
            self._propose(number + 1, proposal)

    def _tell_wait(self, up: list[int], waited: float) -> None:
        """Says once that the first generation waits for hosts to come up."""
        if self._told_wait or waited < WAIT_NOTICE_SECONDS:
            return
        self._told_wait = True
        missing = [r for r in range(self.job.hosts) if r not in up]
        say(f"waited {waited:.0f}s for hosts {missing} to reach the rendezvous "
            f"({len(up)} of {self.job.hosts} up); the job starts without them after "
            f"--rejoin-after {self.job.rejoin_after:g}s if at least --min-workers "
            f"{self.job.min_workers} are up")

    def _propose(self, number: int, proposal: policy.Proposal) -> None:
        if policy.ends_the_job(self.job, proposal):
            code = next((e["code"] for e in self.rz.exits(number - 1).values()
                         if e["code"] != 0), 1)
            self.rz.finish("failed", {"reason": policy.failure_reason(self.job, proposal),
                                      "code": exit_status(code)})
            return
        self.rz.propose(number, list(proposal.members), proposal.reason, proposal.restarts,
                        proposal.save_first)
