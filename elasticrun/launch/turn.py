"""One turn of the agent's round loop: what our node saw, and what to do about it (no I/O).

The round loop (:mod:`elasticrun.launch.roundloop`) looks twice each turn. First at our own node
(:class:`WorkersSeen`: the outage guard's verdict, our worker group, the in-place re-form, the
hang watch); :func:`decide_workers` settles the turn from that alone when it can, so a worker of
ours that failed is reported as the round's failure even when the round changed meanwhile. Only
when it settles nothing does the loop read the job
(:class:`RoundSeen`: why the round is over, the round's failure rows when our step stood still,
whether our workers may be kept) and :func:`decide_round` says how the round ends for us.

The decisions are pure functions of those snapshots; the loop carries the returned action out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Union

from elasticrun.launch.hang import skip_grace
from elasticrun.launch.workers import GroupState
from elasticrun.rendezvous.states import RoundOutcome

TURN_S = 0.5  # the longest wait between turns (local-clock conditions: lease validity, windows)
BUSY_TURN_S = 0.02  # between turns while an in-place re-form or a newcomer's start is under way
MIN_TURN_S = 0.01  # the shortest wait for a scale-up window about to close


@dataclass(frozen=True)
class Stall:
    """The hang watch's reading (``--hang-timeout``): our node's reported step and how long it stood still."""

    step: Optional[int]
    stalled_for: float
    timeout: float

    @property
    def hung(self) -> bool:
        """The step has not advanced for the whole ``--hang-timeout``."""
        return self.stalled_for >= self.timeout


@dataclass(frozen=True)
class WorkersSeen:
    """What a turn saw of our own node."""

    fenced: bool  # the outage guard found our lease gone and stopped our workers
    workers: GroupState
    inplace_failed: Optional[str] = None  # why the in-place re-form gave up this turn (None: it did not)
    stall: Optional[Stall] = None  # None: no hang watch (--hang-timeout 0)
    done_reported: bool = False  # our workers' success is already in etcd


@dataclass(frozen=True)
class RoundSeen:
    """What a turn saw of the job, once our node settled nothing."""

    change: Optional[str]  # why the round is over (None: it runs); RoundOutcome.SUCCEEDED: every member finished
    stall: Optional[Stall] = None
    failure_rows: Sequence[Dict[str, Any]] = field(default_factory=tuple)  # the round's, every node's
    can_keep: bool = False  # in-place re-forming may keep our workers through this change


class WorkersEnd(str, enum.Enum):
    """How our workers end with a round that changed."""

    KEEP = "keep"  # they train on and re-form in place in the next round
    GRACEFUL = "graceful"  # SIGTERM, --shutdown-timeout to save, then SIGKILL
    KILL = "kill"  # SIGKILL now: stuck in a collective with a hung rank, they would wait out the grace


@dataclass(frozen=True)
class Fenced:
    """Our lease is gone; the outage guard stopped our workers: form the next round."""


@dataclass(frozen=True)
class WorkerFailed:
    """A worker of ours failed: report the round failed, stop the others gracefully."""


@dataclass(frozen=True)
class InPlaceFailed:
    """The in-place re-form gave up: report it as a failure of our workers and kill them (a half-made group)."""

    why: str


@dataclass(frozen=True)
class Hung:
    """Our workers' step stood still for ``--hang-timeout``: dump their stacks, report the hang, kill them."""

    stall: Stall


@dataclass(frozen=True)
class ReportSucceeded:
    """Every worker of ours exited 0: say so in etcd (once) and turn again at once."""


@dataclass(frozen=True)
class JobSucceeded:
    """Every member finished: end the job as succeeded and stop our workers."""


@dataclass(frozen=True)
class RoundChanged:
    """The round is over for another reason than our workers; ``end`` says what happens to them.
    ``stuck``: our workers are stuck in a hang another node detected (the hang watch's reading):
    dump their stacks and report them before they are killed."""

    why: str
    end: WorkersEnd
    stuck: Optional[Stall] = None


@dataclass(frozen=True)
class KeepRunning:
    """Nothing changed: the leader's scale-up duty, then wait for the next change or turn."""


Action = Union[Fenced, WorkerFailed, InPlaceFailed, Hung, ReportSucceeded, JobSucceeded, RoundChanged, KeepRunning]


def decide_workers(seen: WorkersSeen) -> Optional[Action]:
    """What our own node's state asks for this turn; None when it settles nothing (read the job then).

    In this order: a lost lease; a failed worker (it beats everything after it, a round change
    included: the round failed with our worker); an in-place re-form that gave up; a hang (judged
    only while the workers run: a finished or failed group is not hung); our workers' success,
    reported once.
    """
    if seen.fenced:
        return Fenced()
    if seen.workers is GroupState.FAILED:
        return WorkerFailed()
    if seen.workers is GroupState.RUNNING and seen.inplace_failed is not None:
        return InPlaceFailed(seen.inplace_failed)
    if seen.workers is GroupState.RUNNING and seen.stall is not None and seen.stall.hung:
        return Hung(seen.stall)
    if seen.workers is GroupState.SUCCEEDED and not seen.done_reported:
        return ReportSucceeded()
    return None


def stuck_with_the_round(stall: Optional[Stall], rows: Sequence[Dict[str, Any]]) -> bool:
    """The round ended for a hang another node detected, and our step stands still too: our workers
    are stuck with it (see :func:`elasticrun.launch.hang.skip_grace`). Every other end gets the grace."""
    return stall is not None and skip_grace(stall.stalled_for, stall.timeout, list(rows))


def needs_failure_rows(stall: Optional[Stall]) -> bool:
    """Whether the round's failure rows can change the decision: only while our step stood still for
    half the ``--hang-timeout`` (below that no hang can hold our workers)."""
    return stall is not None and stall.stalled_for >= stall.timeout / 2


def decide_round(seen: RoundSeen) -> Action:
    """What the job's state asks for, once our node settled nothing.

    A round that changed keeps our workers only when in-place re-forming may, and never when they
    are stuck with another node's hang; those are killed at once, every other end gives the grace
    (a planned end during a long save included).
    """
    if seen.change is None:
        return KeepRunning()
    if seen.change is RoundOutcome.SUCCEEDED:
        return JobSucceeded()
    if stuck_with_the_round(seen.stall, seen.failure_rows):
        return RoundChanged(seen.change, WorkersEnd.KILL, stuck=seen.stall)
    return RoundChanged(seen.change, WorkersEnd.KEEP if seen.can_keep else WorkersEnd.GRACEFUL)


def wait_before_next_turn(scale_up_in: Optional[float], busy: bool) -> float:
    """Seconds to wait for a change before the next turn: short while an in-place re-form or a newcomer's
    start is under way; else until a scale-up window closes (``scale_up_in``), at most :data:`TURN_S`."""
    if busy:
        return BUSY_TURN_S
    if scale_up_in is None:
        return TURN_S
    return min(TURN_S, max(MIN_TURN_S, scale_up_in))


__all__ = ["Action", "Fenced", "Hung", "JobSucceeded", "KeepRunning", "InPlaceFailed", "ReportSucceeded",
           "RoundChanged", "RoundSeen", "Stall", "WorkerFailed", "WorkersEnd", "WorkersSeen", "decide_round",
           "decide_workers", "needs_failure_rows", "stuck_with_the_round", "wait_before_next_turn"]
