"""The agent's small state vocabularies, as enums (``str`` enums: they compare equal to their values)."""

from __future__ import annotations

import enum


class GroupState(str, enum.Enum):
    """What this node's worker group is doing (:meth:`WorkerGroup.poll`)."""

    IDLE = "idle"  # no workers started
    RUNNING = "running"  # some still run, none failed
    SUCCEEDED = "succeeded"  # all exited 0
    FAILED = "failed"  # at least one exited non-zero


class RoundOutcome(str, enum.Enum):
    """How a round ended for this agent."""

    SUCCEEDED = "succeeded"  # every node's workers finished: the job is done
    NEXT = "next"  # the round ended (failure, membership change, fencing): form the next one


class JobState(str, enum.Enum):
    """A job's terminal state (the ``state`` key's ``state`` field)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


__all__ = ["GroupState", "JobState", "RoundOutcome"]
