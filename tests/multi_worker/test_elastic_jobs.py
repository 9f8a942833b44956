"""Tier 2: `keras-dist launch --min-workers` loses and regains workers, and the
run is still the one an uninterrupted 2-worker job gives."""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from multi_worker._cluster import run_workers, workers_of
from multi_worker.test_backup_jobs import SCRIPT, max_diff, weights

pytestmark = pytest.mark.multi_worker

N = 48  # samples
STEPS = 4  # per epoch: global batch 12
STARTING = re.compile(r"\[keras-dist\] (?:restart: )?starting (\d+) worker")
RESIZE = re.compile(r"\[keras-dist\] resize: (\d+) -> (\d+) workers because (.*)")
RESTORED = re.compile(r"\[worker 0\] .*BackupAndRestore: restored .*\(epoch (\d+), step (\d+)\)")


class ElasticJob:
    """A `keras-dist launch` of backup_main.py, disturbed from outside."""

    def __init__(self, tmp_path, *options, num_workers=3, min_workers=1, rejoin_after=7):
        self.ids = tmp_path / "job" / "ids-rank0.txt"
        self.out_dir = tmp_path / "job"
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_dist.cli", "launch",
             "--num-workers", str(num_workers), "--min-workers", str(min_workers),
             "--rejoin-after", str(rejoin_after), "--grace-period", "3",
             SCRIPT, str(self.out_dir), str(tmp_path / "backup"), *options],
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def generations(self) -> int:
        return sum(1 for line in list(self.lines) if STARTING.search(line))

    def size(self) -> int:
        sizes = [int(m.group(1)) for m in map(STARTING.search, list(self.lines)) if m]
        return sizes[-1] if sizes else 0

    def workers(self) -> list[int]:
        """The launcher's live worker processes."""
        return workers_of(self.proc.pid)

    def steps_recorded(self) -> int:
        if not self.ids.exists():
            return 0
        return sum(1 for line in open(self.ids) if line[:1].isdigit())

    def wait_for_a_step(self, generation: int, recorded: int, timeout=180) -> bool:
        """True once generation `generation` runs with all its workers and has
        recorded a step beyond `recorded`; False when the job ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if (self.generations() == generation and self.steps_recorded() > recorded
                    and len(self.workers()) == self.size()):
                return True
            time.sleep(0.05)
        raise AssertionError("no step within the timeout:\n" + self.output()[-5000:])

    def unpace(self):
        """The disturbances are over: the workers stop pacing their steps."""
        (self.out_dir / "unpaced").touch()

    def stop(self):
        """Interrupts the launcher (it stops its workers) after a failed check."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.finish(timeout=60)

    def finish(self, timeout=300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(timeout=10)
        # The launcher's last lines tell a slow job from a stuck one.
        assert code is not None, (
            f"the job did not end within {timeout} s:\n" + self.output()[-5000:])
        return code


def succeeded(job):
    """Waits for the job; its output and its resizes (before, after, reason)."""
    code = job.finish()
    out = job.output()
    assert code == 0, out[-5000:]
    return out, [m.groups() for m in map(RESIZE.search, out.splitlines()) if m]


def last_record_per_step(ids_file):
    """{(epoch, step): ids} keeping the step as last trained (a resumed run
    trains again what its backup did not hold)."""
    kept = {}
    for line in open(ids_file):
        if line[:1].isdigit():
            parts = line.split()
            kept[(int(parts[0]), int(parts[1]))] = sorted(int(i) for i in parts[2:])
    return kept


_REFERENCES = {}  # training options (backup frequency left out) -> weights


def uninterrupted(tmp_path, options):
    """The weights of an uninterrupted 2-worker run with these training
    options. How often backups are saved changes no weight: the jobs here
    that differ only in it share one reference run."""
    key = tuple(o for o in options if not o.startswith("freq="))
    if key not in _REFERENCES:
        run_workers(SCRIPT, [str(tmp_path / "ref"), str(tmp_path / "ref-backup"), *key])
        _REFERENCES[key] = weights(tmp_path / "ref" / "rank0.npz")
    return _REFERENCES[key]


def check_the_run(tmp_path, job, options, epochs):
    """Weights of an uninterrupted 2-worker run on every final worker; each
    sample trained once per epoch; every step of every epoch trained."""
    reference = uninterrupted(tmp_path, options)
    final = job.size()
    for rank in range(final):
        assert max_diff(reference, weights(job.out_dir / f"rank{rank}.npz")) < 1e-5
    kept = last_record_per_step(job.ids)
    assert sorted(kept) == [(e, s) for e in range(epochs) for s in range(STEPS)]
    for epoch in range(epochs):
        seen = sorted(i for s in range(STEPS) for i in kept[(epoch, s)])
        assert seen == list(range(N)), f"epoch {epoch}: {seen}"
    assert not (tmp_path / "backup").exists()  # deleted when training ended


def resumed_positions(output):
    """(generation index, next step index) of each resume, from worker 0's lines."""
    positions, generation = [], 0
    for line in output.splitlines():
        if STARTING.search(line):
            generation += 1
        match = RESTORED.search(line)
        if match:
            positions.append((generation, (int(match.group(1)) - 1) * STEPS
                              + int(match.group(2))))
    return positions


def records_per_generation(ids_file):
    runs = []
    for line in open(ids_file):
        if line.startswith("start"):
            runs.append([])
        elif line[:1].isdigit():
            epoch, step = map(int, line.split()[:2])
            runs[-1].append(epoch * STEPS + step)
    return runs


def test_a_job_shrinks_on_a_kill_and_a_preemption_then_grows_back(tmp_path):
    """3 workers; SIGKILL one (no restarts left): 2 workers; SIGTERM one
    (preemption: it saves, exits 42): 1 worker, not a step lost; after
    --rejoin-after the launcher grows the job back to 3."""
    epochs = 16
    options = ["batch=12", "freq=4", "bn=1", f"epochs={epochs}"]
    job = ElasticJob(tmp_path, *options, "sleep=0.3", rejoin_after=8)
    try:
        for generation, (signum, rank) in enumerate(
                [(signal.SIGKILL, 2), (signal.SIGTERM, 0)], start=1):
            assert job.wait_for_a_step(generation, job.steps_recorded())
            time.sleep(0.4)
            victim = sorted(job.workers())[rank]
            os.kill(victim, signum)
        # Paced until the grow-back (after 8 s on fewer workers) has started.
        while job.generations() < 4 and job.proc.poll() is None:
            time.sleep(0.1)
        job.unpace()
    except BaseException:
        job.stop()
        raise
    out, resizes = succeeded(job)
    assert [(int(a), int(b)) for a, b, _ in resizes] == [(3, 2), (2, 1), (1, 3)], out
    assert "killed by SIGKILL and the restarts are used up (0/0)" in resizes[0][2]
    assert "exited with code 42 (preempted: it saved a backup)" in resizes[1][2]
    assert "it trained 8s on fewer than 3 workers" in resizes[2][2]
    # The preempted generation saved where it stopped: the next one goes on
    # from the step after its last, with a backup every 4 steps otherwise.
    runs = records_per_generation(job.ids)
    positions = dict(resumed_positions(out))
    assert positions[3] == runs[1][-1] + 1
    check_the_run(tmp_path, job, options, epochs)


def test_random_kill_shrink_grow_events(tmp_path, request):
    """Many events in one job: SIGKILLs and SIGTERMs (seeded order and
    victims, unseeded timing) of a worker of the full job, each after a
    step of the generation it hits, and the launcher's grow-back after each.
    20 events with `--soak` (10 signals, 5 of each kind; about 5 minutes),
    4 otherwise (a SIGKILL and a SIGTERM, in seeded order: the second hits
    a group that has just grown back).

    Signals go to the full job only: below full size the launcher's own
    grow-back SIGTERMs every worker, and a worker that gets it while it
    still saves for the test's SIGTERM takes the second signal as a
    forced stop (as BackupAndRestore documents). The shrink to one worker
    is test_a_job_shrinks_on_a_kill_and_a_preemption_then_grows_back's."""
    soak = request.config.getoption("--soak")
    wanted = 20 if soak else 4
    epochs = 30 if soak else 16
    options = ["batch=12", "freq=1", "bn=1", f"epochs={epochs}"]
    rng = random.Random(22)
    plan = [signal.SIGKILL, signal.SIGTERM] * (wanted // 4)
    rng.shuffle(plan)
    job = ElasticJob(tmp_path, *options, "sleep=0.4", rejoin_after=2)
    fired = []
    try:
        for signum in plan:
            generation = max(job.generations(), 1)
            if not job.wait_for_a_step(generation, job.steps_recorded()):
                break  # the job ended
            assert job.size() == 3, job.output()[-5000:]
            time.sleep(rng.uniform(0, 0.6))
            os.kill(rng.choice(sorted(job.workers())), signum)
            fired.append(signum)
            # The shrink, then the grow back to 3.
            while job.generations() < generation + 2 and job.proc.poll() is None:
                time.sleep(0.1)
        job.unpace()
    except BaseException:
        job.stop()
        raise
    out, resizes = succeeded(job)
    assert fired == plan, out[-5000:]
    expected = []
    for signum in plan:
        expected += [("kill" if signum == signal.SIGKILL else "preempt", 3, 2),
                     ("grow", 2, 3)]
    got = [("grow" if int(after) > int(before) else
            "preempt" if "preempted" in reason else "kill", int(before), int(after))
           for before, after, reason in resizes]
    assert got == expected, resizes
    check_the_run(tmp_path, job, options, epochs)


def start_host(tmp_path, hosts, rank, options, log, rendezvous=None):
    return subprocess.Popen(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--hosts", ",".join(hosts),
         "--rank", str(rank), "--min-workers", "1", "--rejoin-after", "10",
         # A preempted host's worker saves with its peers before it exits 42:
         # under load that took over 3 s (the worker was then SIGKILLed and
         # its host counted as lost, not preempted). A worker that exits on
         # its own never waits for the grace period.
         "--rendezvous", rendezvous or str(tmp_path / "rendezvous"), "--grace-period", "20",
         SCRIPT, str(tmp_path / "job"), str(tmp_path / "backup"), *options],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""),
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )




def wait_until(condition, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(params=["directory", "etcd"])
def rendezvous(request, tmp_path):
    """Where the launchers agree: a shared directory, or a real etcd on
    127.0.0.1 (`etcd://host:port/prefix`); with a reader of its records."""
    from keras_dist.launchers.rendezvous import open_rendezvous

    if request.param == "directory":
        where = str(tmp_path / "rendezvous")
        yield where, lambda: open_rendezvous(where, 0, 3)
        return
    from etcd_server import running_etcd

    with running_etcd(str(tmp_path / "etcd-data")) as address:
        where = f"etcd://{address}/job"
        yield where, lambda: open_rendezvous(where, 0, 3)


def test_hosts_agree_through_a_rendezvous(tmp_path, rendezvous):
    """3 launchers (one per "host", all on 127.0.0.1) with --rendezvous: the
    host of the chief is lost (launcher and worker SIGKILLed) -> the other
    two go on, host 1's worker the chief; host 0 comes back -> the job grows
    back to 3, host 0's worker the chief again; host 2 is preempted (SIGTERM
    to its launcher: its worker saves, exits 42) -> hosts 0 and 1 finish,
    not a step lost; the run = 2 workers uninterrupted. On a shared
    directory and on etcd."""
    from keras_dist._cluster import loopback_ports

    where, reader = rendezvous
    rz = reader()

    epochs = 20
    options = ["batch=12", "freq=2", "bn=1", f"epochs={epochs}"]
    hosts = [f"127.0.0.1:{p}" for p in loopback_ports(3)]
    logs = [open(tmp_path / f"host{r}.log", "a") for r in range(3)]
    launchers = [start_host(tmp_path, hosts, r, [*options, "sleep=0.3"], logs[r], where)
                 for r in range(3)]
    ids = tmp_path / "job" / "ids-rank0.txt"

    def steps():
        return sum(1 for line in open(ids) if line[:1].isdigit()) if ids.exists() else 0

    def generations():
        return [rz.read(f"generation-{n}.json") for n in range(1, rz.latest()[0] + 1)]

    try:
        wait_until(lambda: steps() >= 2, "the first steps")
        for pid in workers_of(launchers[0].pid):
            os.kill(pid, signal.SIGKILL)
        launchers[0].kill()
        launchers[0].wait()
        wait_until(lambda: len(generations()) >= 2, "the survivors' generation")
        before = steps()
        wait_until(lambda: steps() > before, "a step on 2 hosts")
        launchers[0] = start_host(tmp_path, hosts, 0, [*options, "sleep=0.3"], logs[0], where)
        wait_until(lambda: len(generations()) >= 3, "the grown generation")
        # Two steps of generation 3 itself (generation 2's last steps, taken
        # while it saves, come after generation 3's first line too), its
        # chief past its restore: SIGTERM then reaches a worker inside fit.
        wait_until(lambda: (
            "restored" in (tmp_path / "host0.log").read_text().split("generation 3:")[-1]
            and len(records_per_generation(ids)) >= 3
            and len(records_per_generation(ids)[2]) >= 2
        ), "steps on 3 hosts")
        launchers[2].send_signal(signal.SIGTERM)  # host 2 is preempted
        wait_until(lambda: len(generations()) >= 4, "the generation without host 2")
        (tmp_path / "job" / "unpaced").touch()  # the rest at full speed
        codes = [launcher.wait(timeout=300) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
        for log in logs:
            log.close()
    out = {r: (tmp_path / f"host{r}.log").read_text() for r in range(3)}
    assert codes == [0, 0, 128 + signal.SIGTERM], out
    made = generations()
    assert [g["members"] for g in made] == [[0, 1, 2], [1, 2], [0, 1, 2], [0, 1]], made
    assert "lost" in made[1]["reason"] and "up again" in made[2]["reason"], made
    assert "[2] left, preempted (the workers saved a backup and exited 42)" in made[3]["reason"]
    # The preemption lost no step: generation 4 goes on after generation 3's last.
    runs = records_per_generation(ids)
    assert len(runs) == 4, runs
    restored = [m for m in map(RESTORED.search, out[0].splitlines()) if m][-1]
    assert (int(restored.group(1)) - 1) * STEPS + int(restored.group(2)) == runs[2][-1] + 1
    # Who was chief: host 1's worker in generation 2, host 0's in 3.
    assert f"generation 2: starting worker 0 of 2 ({hosts[1]}; chief {hosts[1]})" in out[1]
    assert f"generation 3: starting worker 0 of 3 ({hosts[0]}; chief {hosts[0]})" in out[0]

    class Done:
        out_dir = tmp_path / "job"
        size = staticmethod(lambda: 2)

    Done.ids = ids
    check_the_run(tmp_path, Done, options, epochs)
