"""What the rendezvous protocol needs from the launch configuration, and what it raises.

Also :func:`describe_mismatch`: how a joining node's settings differ from the job's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from elasticrun.rendezvous.states import JobState


class JobEnded(Exception):
    """The job reached a terminal state (``state`` key): succeeded, failed or stopped. ``spare``: no
    round included this node (it waited as a spare and ran no worker)."""

    def __init__(self, state: Dict[str, Any], spare: bool = False) -> None:
        super().__init__(state.get("reason", state.get("state", "")))
        self.state = state
        self.spare = spare

    @property
    def succeeded(self) -> bool:
        return self.state.get("state") == JobState.SUCCEEDED.value

    @property
    def stopped(self) -> bool:
        """Every node left before an outcome (see :mod:`elasticrun.rendezvous.ended`)."""
        return self.state.get("state") == JobState.STOPPED.value


class LeaseLost(Exception):
    """Our lease expired or could not be confirmed: we must fence ourselves and rejoin."""


class JobChanged(Exception):
    """A registration found the job's ``config`` or ``state`` changed since this node checked them
    (the job ended, or was replaced by another under the same id): check again."""


@dataclass
class RendezvousSettings:
    """What the protocol needs from the launch configuration."""

    job_id: str  # --rdzv-id
    min_nodes: int
    max_nodes: int
    max_restarts: int
    heartbeat_timeout: float
    stability_window: float
    rescale_timeout: float
    join_timeout: float
    # Liveness: a main loop silent this long stops refreshing the lease (None: no gate).
    stall_after: Optional[float] = None
    # How long to wait for the members of the previous round to stop their workers before
    # forming the next round without them (a node that neither stops nor loses its lease).
    busy_timeout: float = 60.0
    restart_window: float = 0.0  # --restart-window: count max_restarts within this many seconds (0: whole job)
    ended_ttl: float = 0.0  # --ended-job-ttl: seconds an ended job's keys stay in etcd (0: forever)
    record_end: bool = True  # a leaving node records a stopped job (False: the job's etcd may be gone by then)

    @property
    def rejoin_grace(self) -> float:
        """After an etcd outage, how long a member may be missing before its round is over."""
        return 2.0 * self.heartbeat_timeout


def describe_mismatch(existing: Dict[str, Any], mine: Dict[str, Any]) -> Optional[str]:
    """A one-line description of how ``mine`` differs from the job's settings, or None."""
    diffs = []
    for key in sorted(set(existing) | set(mine)):
        if existing.get(key) != mine.get(key):
            diffs.append(f"{key}: job has {existing.get(key)!r}, this node has {mine.get(key)!r}")
    return "; ".join(diffs) if diffs else None
