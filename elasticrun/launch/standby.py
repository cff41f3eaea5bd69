"""When a running round pre-warms the standby interpreters of the next round.

A restart or a rescale starts its workers from interpreters that already imported torch
(:meth:`elasticrun.launch.workers.WorkerGroup.prewarm`). The round loop asks :class:`Standby`
once a turn; it pre-warms once per round:

- :data:`STANDBY_DELAY_S` after the round started, once this round's workers are past their own
  start-up (they compete for the same CPUs), with DDP's extra imports (``deep``);
- at once when a node is joining (the round ends within a stability window), torch only, so the
  standbys are ready when the next round forms.
"""

from __future__ import annotations

from typing import Callable, Optional

STANDBY_DELAY_S = 2.0  # after a round starts, when to pre-warm the next round's workers


def prewarm_due(now: float, at: Optional[float], joining: bool) -> Optional[bool]:
    """Whether to pre-warm now, and how deep: None (not now, or done for this round: ``at`` None);
    True (deep: the delay after the round's start passed); False (torch only: a node is joining)."""
    if at is None:
        return None
    if joining:
        return False
    return True if now >= at else None


class Standby:
    """One round's pre-warming: :meth:`turn` once per turn of the round loop."""

    def __init__(self, prewarm: Callable[[bool], None], started_at: float, delay: float = STANDBY_DELAY_S) -> None:
        self._prewarm = prewarm  # deep -> None (WorkerGroup.prewarm)
        self._at: Optional[float] = started_at + delay  # None once pre-warmed

    def turn(self, now: float, joining: bool) -> None:
        """Pre-warm if due (``joining``: a node is joining the job, the round ends soon)."""
        deep = prewarm_due(now, self._at, joining)
        if deep is not None:
            self._at = None
            self._prewarm(deep)


__all__ = ["STANDBY_DELAY_S", "Standby", "prewarm_due"]
