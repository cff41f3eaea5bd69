"""The rendezvous's state vocabularies, as enums (``str`` enums: they compare equal to their
values, and the values are what etcd and ``elasticrun status --json`` carry). :class:`JobState`,
what the ``state`` record holds, is defined with that record's check in :mod:`elasticrun.job.records`."""

from __future__ import annotations

import enum

from elasticrun.job.records import JobState  # the state record's vocabulary, with its check


class RoundOutcome(str, enum.Enum):
    """How a round ended for this agent."""

    SUCCEEDED = "succeeded"  # every node's workers finished: the job is done
    NEXT = "next"  # the round ended (failure, membership change, fencing): form the next one


class JobPhase(str, enum.Enum):
    """One word for a job in ``elasticrun status`` (the status document's ``phase``)."""

    FORMING = "forming"  # no round yet
    RUNNING = "running"  # a round runs and every member is active
    RESCALING = "rescaling"  # the round is ending (a failure, an end marker, a lost or failed member)
    SUCCEEDED = "succeeded"  # terminal: the job's JobState
    FAILED = "failed"  # terminal: the job's JobState
    STOPPED = "stopped"  # terminal: every node left before an outcome (its id is free again)
    GONE = "gone"  # ``status --watch`` only: the job's keys were deleted while watched


TERMINAL_PHASES = (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)  # the phases of a job that has ended


class MemberStatus(str, enum.Enum):
    """A round member's status in a status document beyond its node record's
    :class:`~elasticrun.rendezvous.records.WorkerStatus` (``Active``, ``Failed``, ...)."""

    LOST = "Lost"  # its node record is gone without a word (its lease expired: death, pause, partition)
    LEFT = "Left"  # it left the round on a signal (SIGTERM, Ctrl-C: ``rounds/<n>/left/<node>``)
    FINISHED = "Finished"  # its workers all exited 0, or it left a job that ended


__all__ = ["TERMINAL_PHASES", "JobPhase", "JobState", "MemberStatus", "RoundOutcome"]
