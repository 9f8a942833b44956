"""What the leader of an elastic multi-host job decides, as plain functions.

The launchers (`keras_dist/launchers/rendezvous.py`) read the rendezvous
(who is alive, the current generation, the exits recorded for it) and the
clock, ask these functions what to do, and carry the answer out. Nothing
here touches a file, a process or TensorFlow, so every rule (start, restart,
shrink, grow, a lost host, a preemption, too few hosts) is checked against
plain event sequences in milliseconds (tests/test_elastic_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from keras_dist._exit_codes import PREEMPTED as PREEMPTED_EXIT_CODE
from keras_dist.launchers.supervisor import describe_exit as describe

STALE_SECONDS = 5.0
"""A host whose heartbeat is older than this is lost."""
SETTLE_SECONDS = STALE_SECONDS + 1.0
"""After a worker fails: how long the leader waits for the failures it caused
(and for a lost host's heartbeat to go stale) before regrouping."""


@dataclass(frozen=True)
class Job:
    """The job's fixed terms."""

    hosts: int
    min_workers: int
    max_restarts: int
    rejoin_after: float
    start_timeout: float | None = None


@dataclass(frozen=True)
class Proposal:
    """The next generation: its members (host ranks) and why it is made.

    `restarts`: restarts used so far, carried by the generation.
    `save_first`: the running workers save a backup before they stop (a
    grow; nothing failed). A proposal with fewer members than `min_workers`
    ends the job instead (see `ends_the_job`).
    """

    members: tuple[int, ...]
    reason: str
    restarts: int
    save_first: bool = False


def ends_the_job(job: Job, proposal: Proposal) -> bool:
    return len(proposal.members) < job.min_workers


def failure_reason(job: Job, proposal: Proposal) -> str:
    return (f"{proposal.reason}: {len(proposal.members)} host(s) left, fewer than "
            f"min_workers={job.min_workers}")


def first_generation(job: Job, alive: list[int], waited: float) -> Proposal | None:
    """Generation 1: when every host is up, or enough are after a wait."""
    if len(alive) == job.hosts or (
            waited >= job.rejoin_after and len(alive) >= job.min_workers):
        return Proposal(tuple(alive), f"{len(alive)} of {job.hosts} hosts are up", 0)
    if job.start_timeout is not None and waited >= job.start_timeout:
        return Proposal(tuple(alive), f"{len(alive)} of {job.hosts} hosts are up after "
                        f"{job.start_timeout:g}s (start_timeout)", 0)
    return None


def after_a_failure(job: Job, members: list[int], restarts: int, alive: list[int],
                    failed: dict[int, dict], now: float,
                    leaving: tuple[int, ...] = ()) -> Proposal | None:
    """A member's worker exited non-zero (`failed`: rank -> {code, time}).

    Waits `SETTLE_SECONDS` after the first failure for the ones it caused.
    A lost host, one that announced it leaves (`leaving`: its launcher got
    SIGTERM and still beats while its worker saves) or a preemption
    regroups the staying hosts without counting a restart; any other
    failure is a restart while restarts are left, after which the host
    whose worker failed first is left out.
    """
    first = min(failed, key=lambda r: failed[r]["time"])
    if now - failed[first]["time"] < SETTLE_SECONDS:
        return None
    code = failed[first]["code"]
    reason = f"host {first}'s worker {describe(code)}"
    staying = [a for a in alive if a not in leaving]
    gone = [m for m in members if m not in staying]
    lost = [m for m in gone if m not in leaving]
    if gone and (code == PREEMPTED_EXIT_CODE or not lost):
        reason = (f"host(s) {gone} left, preempted (the workers saved a backup and "
                  "exited 42)" if code == PREEMPTED_EXIT_CODE else
                  f"host(s) {gone} left ({reason})")
    elif gone:
        reason = f"host(s) {gone} lost (no heartbeat for {STALE_SECONDS:g}s; {reason})"
    elif code == PREEMPTED_EXIT_CODE:
        # A worker saved and exited 42 while its host stays: the same
        # hosts go on, not counting a restart.
        reason += " (preempted: it saved a backup)"
    elif restarts < job.max_restarts:
        restarts += 1
        reason += f" (restart {restarts}/{job.max_restarts})"
    else:
        reason += f" and the restarts are used up ({restarts}/{job.max_restarts})"
        return Proposal(tuple(m for m in staying if m != first), reason, restarts)
    return Proposal(tuple(staying), reason, restarts)


def next_generation(job: Job, number: int, generation: dict, alive: list[int],
                    exits: dict[int, dict], now: float, lost_since: float | None,
                    leaving: tuple[int, ...] = ()) -> tuple[Proposal | None, float | None]:
    """The generation after `number`, or None for now; and `lost_since`.

    `generation`: its members, restarts and creation time. `exits`: the
    exits recorded for it (rank -> {code, time}). `lost_since`: when the
    leader first saw a member of this generation lost (None: not yet),
    returned updated. `leaving`: hosts whose launcher announced that it
    leaves the job (they may still beat while their worker saves); never
    members of a later generation.
    """
    members, restarts = list(generation["members"]), generation["restarts"]
    failed = {r: e for r, e in exits.items() if e["code"] != 0}
    if failed:
        return (after_a_failure(job, members, restarts, alive, failed, now, leaving),
                lost_since)
    staying = [a for a in alive if a not in leaving]
    lost = [m for m in members if m not in alive]
    if lost:
        # Give the exits a lost host caused (or its preemption record) time
        # to come in first.
        lost_since = lost_since if lost_since is not None else now
        if now - lost_since < SETTLE_SECONDS:
            return None, lost_since
        return Proposal(tuple(staying), f"host(s) {lost} lost (no heartbeat for "
                        f"{STALE_SECONDS:g}s)", restarts), lost_since
    if any(m in leaving for m in members):
        # A member's worker is saving before its host leaves: its exit, and
        # the exits of the workers that save with it, are on their way.
        return None, lost_since
    back = sorted(set(staying) - set(members))
    if back and now - generation["time"] >= job.rejoin_after:
        return Proposal(tuple(staying), f"host(s) {back} are up again "
                        f"({job.rejoin_after:g}s after generation {number} began)", restarts,
                        save_first=True), lost_since
    return None, lost_since


# A local job (one launcher, every worker on this machine): the launcher
# sees the whole group's outcome at once, so a failure shrinks the group by
# one worker (renumbered) instead of leaving a named host out.


@dataclass(frozen=True)
class LocalDecision:
    """What a local job does after its group stopped.

    `action`: "restart" (same size, one more restart), "resize" (to `size`;
    no restart counted) or "fail" (the job ends with the group's status).
    """

    action: str
    size: int
    restarts: int
    reason: str


def resize_after(job: Job, size: int, elastic: bool) -> float | None:
    """How long a local group of `size` trains before it stops to grow
    back to `job.hosts` workers (None: it does not)."""
    return job.rejoin_after if elastic and size < job.hosts else None


def after_a_local_stop_to_grow(job: Job, restarts: int, code: int,
                               reason: str) -> LocalDecision:
    """The group stopped (or saved and exited) to grow back to full size."""
    why = ("the group saved and exited to grow)" if code == PREEMPTED_EXIT_CODE else
           f"stopped to grow: {reason}; it goes on from the last backup)")
    return LocalDecision("resize", job.hosts, restarts,
                         f"it trained {job.rejoin_after:g}s on fewer than {job.hosts} "
                         f"workers ({why}")


def after_a_local_failure(job: Job, size: int, restarts: int, code: int, reason: str,
                          elastic: bool) -> LocalDecision:
    """A worker of a local group failed (`code`) and the group stopped.

    A preemption shrinks an elastic group by one without counting a
    restart; any other failure is a restart while restarts are left, then
    a shrink by one while the group is above `min_workers`, then the end.
    """
    can_shrink = elastic and size > job.min_workers
    if code == PREEMPTED_EXIT_CODE and can_shrink:
        return LocalDecision("resize", size - 1, restarts, reason)
    if restarts < job.max_restarts:
        return LocalDecision("restart", size, restarts + 1, reason)
    if can_shrink:
        return LocalDecision("resize", size - 1, restarts,
                             f"{reason} and the restarts are used up "
                             f"({restarts}/{job.max_restarts})")
    return LocalDecision(
        "fail", size, restarts, reason
        + (f" (after {restarts} restart(s))" if restarts else "")
        + (f" (on {size}, the fewest workers allowed)" if elastic else ""))
