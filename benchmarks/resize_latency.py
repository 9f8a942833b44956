"""Scenario 10: how long an elastic job stops training for a preemption, a
SIGKILL and a grow-back, at epoch 10 and at epoch 1,000, against stopping the
job and starting it again from its backup by hand.

For each starting epoch E, one process trains the digits MLP (64 samples,
4 steps an epoch, a backup every epoch) to epoch E and exits
(`_resize_worker.py --stop-at E`). Then `keras-dist launch --num-workers 2
--min-workers 1 --rejoin-after 3` resumes that backup, and the job is
disturbed in turn:

1. launch: the command's start to the first step (a start from the backup);
2. preemption: SIGTERM to worker 1; the signal to the next step of the
   1-worker group (the save, the exits, the launcher's decision, one
   TensorFlow start and a restore);
3. grow: the launcher's decision to go back to 2 workers (its `resize: 1 ->
   2` line) to the first step of the full group;
4. SIGKILL to worker 1; the kill to the next step, and the steps trained
   again (those after the last backup);
5. by hand: SIGTERM to the launcher (every worker saves and exits), then the
   same `keras-dist launch` again; the signal to the first step;
6. the same script as one plain process (no launcher, one worker) on the
   job's backup: the command's start to its first step, beside 1.

Each figure is split where the launcher's lines allow (its decision, the
new group's start). Wall clock from `time.time()` in this process and in
worker 0's step log (the same machine's clock).

With one starting epoch (`--epochs-at 10`, and `--quick`: epoch 2 only)
the ratios between epochs are left out.

Usage: python -m benchmarks.resize_latency [--epochs-at 10 1000] [--repeats 2]
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import _common

WORKER = os.path.join(_common.ROOT, "benchmarks", "_resize_worker.py")
STEPS = 4  # per epoch
RESIZE = re.compile(r"\[keras-dist\] resize: (\d+) -> (\d+) workers")
STARTING = re.compile(r"\[keras-dist\] (?:restart: )?starting (\d+) worker")


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    return env


class Job:
    """A launched job whose launcher lines and worker 0's steps are timed."""

    def __init__(self, out, backup, epochs):
        self.out, self.lines = out, []
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
             "--min-workers", "1", "--rejoin-after", "3", "--grace-period", "3",
             WORKER, out, backup, "--epochs", str(epochs)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=_common.ROOT,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def steps(self) -> list[tuple[float, int, int]]:
        """(time, pid, global step index) of every step worker 0 logged."""
        path = os.path.join(self.out, "steps.txt")
        if not os.path.exists(path):
            return []
        found = []
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 4:
                    found.append((float(parts[0]), int(parts[1]),
                                  int(parts[2]) * STEPS + int(parts[3])))
        return found

    def first_step_after(self, moment: float, old_pids: set, timeout=240):
        """The first step after `moment` of a process not in `old_pids`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for step in self.steps():
                if step[0] > moment and step[1] not in old_pids:
                    return step
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError("no step came:\n" + self.output()[-3000:])

    def line_after(self, pattern, moment: float, timeout=240) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if when > moment and pattern(line):
                    return when
            time.sleep(0.02)
        raise RuntimeError("no launcher line came:\n" + self.output()[-3000:])

    def pid_of(self, rank: int) -> int:
        with open(os.path.join(self.out, f"rank{rank}.pid")) as f:
            return int(f.read())

    def pids(self) -> set:
        return {step[1] for step in self.steps()}

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def stop(self, timeout=120) -> float:
        """SIGTERM to the launcher; seconds until it exited."""
        start = time.time()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(timeout=10)
        return time.time() - start


def _settle(first_step: float, seconds=1.0):
    """Lets the current group train `seconds` past its first step."""
    time.sleep(max(0.0, first_step + seconds - time.time()))


def _resized(job, after: float) -> bool:
    return any(when > after and RESIZE.search(line) for when, line in list(job.lines))


def _one_process(out, backup, epochs) -> float:
    """The worker script run as one plain process on the job's backup: its
    command's start to its first step (then it is stopped)."""
    started = time.time()
    proc = subprocess.Popen([sys.executable, WORKER, out, backup, "--epochs", str(epochs)],
                            env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=_common.ROOT)
    path = os.path.join(out, "steps.txt")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(path) and os.path.getsize(path):
                with open(path) as f:
                    return float(f.readline().split()[0]) - started
            time.sleep(0.02)
        raise RuntimeError(f"the single process made no step (exit {proc.poll()})")
    finally:
        proc.kill()
        proc.wait()


def one_round(start_epoch: int, quick: bool) -> dict:
    figures = {}
    with tempfile.TemporaryDirectory() as scratch:
        out, backup = os.path.join(scratch, "out"), os.path.join(scratch, "backup")
        epochs = start_epoch + 100_000  # ended by the by-hand stop
        prepared = subprocess.run(
            [sys.executable, WORKER, os.path.join(scratch, "prepare"), backup,
             "--epochs", str(epochs), "--stop-at", str(start_epoch)],
            env=_env(), capture_output=True, text=True, timeout=1800, cwd=_common.ROOT)
        if prepared.returncode != 0:
            raise RuntimeError("preparing the backup failed:\n" + prepared.stderr[-3000:])

        job = Job(out, backup, epochs)
        try:
            first = job.first_step_after(0, set())
            figures["launch: command to first step"] = first[0] - job.started
            if first[2] != start_epoch * STEPS:
                raise RuntimeError(f"the job began at step {first[2]}, not at epoch "
                                   f"{start_epoch}'s first:\n" + job.output()[-3000:])
            _settle(first[0])

            # Preemption of worker 1.
            old = job.pids()
            moment = time.time()
            os.kill(job.pid_of(1), signal.SIGTERM)
            decided = job.line_after(RESIZE.search, moment)
            started = job.line_after(STARTING.search, decided)
            step = job.first_step_after(moment, old)
            figures["preemption: signal to next step"] = step[0] - moment
            figures["preemption, of which: signal to the launcher's decision"] = decided - moment
            figures["preemption, of which: new group's start to its first step"] = (
                step[0] - started)

            # The grow-back after --rejoin-after.
            old = job.pids()
            grow = job.line_after(lambda line: (m := RESIZE.search(line)) is not None
                                  and int(m.group(2)) > int(m.group(1)), step[0])
            step = job.first_step_after(grow, old)
            figures["grow: launcher's decision to first step of 2 workers"] = step[0] - grow
            _settle(step[0])

            # SIGKILL of worker 1.
            old = job.pids()
            moment = time.time()
            os.kill(job.pid_of(1), signal.SIGKILL)
            decided = job.line_after(RESIZE.search, moment)
            step = job.first_step_after(moment, old)
            last = max(s[2] for s in job.steps() if s[1] in old)
            figures["SIGKILL: signal to next step"] = step[0] - moment
            figures["SIGKILL, of which: signal to the launcher's decision"] = decided - moment
            figures["SIGKILL: steps trained again"] = float(max(0, last - step[2] + 1))
            if not quick:
                old = job.pids()
                grow = job.line_after(lambda line: (m := RESIZE.search(line)) is not None
                                      and int(m.group(2)) > int(m.group(1)), step[0])
                _settle(job.first_step_after(grow, old)[0])

            # By hand: stop the job, start it again from its backup.
            old = job.pids()
            moment = time.time()
            figures["by hand: the stop (launcher's SIGTERM to its exit)"] = job.stop()
        except BaseException:
            job.stop(timeout=30)
            raise
        job = Job(out, backup, epochs)
        try:
            step = job.first_step_after(moment, old)
            figures["by hand: signal to first step of the restarted job"] = step[0] - moment
        finally:
            job.stop(timeout=60)
        figures["one process, no launcher: command to first step"] = _one_process(
            os.path.join(scratch, "alone"), backup, epochs)
    return figures


def run(args) -> dict:
    # --quick: one starting epoch (every step of a round, once; the rounds
    # at two epochs cost 24 TensorFlow processes, most of the quick run).
    epochs_at = [2] if args.quick else list(dict.fromkeys(args.epochs_at))
    rounds = _common.repeats(args, 2, quick=1)
    results = {e: [] for e in epochs_at}
    for _ in range(rounds):
        for e in epochs_at:
            results[e].append(one_round(e, args.quick))
    names = list(results[epochs_at[0]][0])
    rows = []
    for name in names:
        for e in epochs_at:
            unit_note = "steps" if "steps trained" in name else "s"
            rows.append(_common.row(f"{name} (epoch {e})",
                                    [r[name] for r in results[e]], unit=unit_note))
    low, high = epochs_at[0], epochs_at[-1]

    def median(e, name):
        return next(r["median"] for r in rows if r["variant"] == f"{name} (epoch {e})")

    across = [  # how each latency grows with the epoch resumed at (two or more epochs)
        {"name": f"preemption to next step, epoch {high} over epoch {low}",
         "value": median(high, "preemption: signal to next step")
         / median(low, "preemption: signal to next step"), "goal": "<= 1.2"},
        {"name": f"grow to first full step, epoch {high} over epoch {low}",
         "value": median(high, "grow: launcher's decision to first step of 2 workers")
         / median(low, "grow: launcher's decision to first step of 2 workers"),
         "goal": "<= 1.2"},
        {"name": f"SIGKILL to next step, epoch {high} over epoch {low}",
         "value": median(high, "SIGKILL: signal to next step")
         / median(low, "SIGKILL: signal to next step"), "goal": "<= 1.2"},
    ] if high != low else []
    ratios = across + [
        {"name": "start-up, launch of 2 workers / one process: command to first step "
                 f"(epoch {high})",
         "value": median(high, "launch: command to first step")
         / median(high, "one process, no launcher: command to first step")},
        {"name": f"preemption to next step over a stop and restart by hand (epoch {high})",
         "value": median(high, "preemption: signal to next step")
         / median(high, "by hand: signal to first step of the restarted job"),
         "goal": "<= 1.0"},
    ]
    return {
        "id": 10, "name": "resize_latency",
        "title": "Elastic job: preemption, SIGKILL and grow-back latency at epoch "
                 + " and ".join(map(str, epochs_at)),
        "setup": (
            "`keras-dist launch --num-workers 2 --min-workers 1 --rejoin-after 3` of "
            "benchmarks/_resize_worker.py (digits MLP 64-64-64-10, 64 samples, global "
            "batch 16, BackupAndRestore every epoch), resumed from a backup written at "
            "the starting epoch by one process; each disturbance timed from its signal "
            "(or the launcher's decision) to worker 0's next logged step; by hand = "
            "SIGTERM to the launcher, then the same command again."
        ),
        "unit": "s", "rows": rows, "ratios": ratios,
    }


if __name__ == "__main__":
    p = _common.parser(__doc__)
    p.add_argument("--epochs-at", type=int, nargs="+", default=[10, 1000])
    _common.main(run, __doc__, p)
