"""Straggler scores: every rank's compute time per step against the job's median, judged over a window.

Synchronous training runs at the slowest rank's pace, and every rank's *wall* time per step is the
same; what tells ranks apart is the time each spends outside collectives (compute), which the workers
report (:class:`elasticrun.train.StepTimer`). A rank whose compute time is at least ``threshold`` ×
the median of all ranks' for ``window_s`` seconds in a row is a straggler; it stops being one after
``window_s`` seconds below the threshold (so one slow phase does not make the flag flap). A rank
less than ``min_excess_s`` behind the median is never slow, whatever its ratio: with steps of a
millisecond or two of compute, the ratio measures the operating system's scheduler, not the node. A node is
a straggler when any of its ranks is. Everything here is pure: the caller feeds readings and the time.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set


class StragglerAction(str, enum.Enum):
    """What the leader does about a straggler (``--straggler-action``)."""

    WARN = "warn"  # flag it: status, events, metrics
    DRAIN = "drain"  # flag it and have its node leave the job gracefully


@dataclass(frozen=True)
class StragglerPolicy:
    """``--straggler-threshold``, ``--straggler-window`` and the freshness of readings."""

    threshold: float = 1.2
    window_s: float = 30.0
    stale_s: float = 15.0  # a reading older than this is no reading (the rank stopped reporting)
    min_ranks: int = 2  # fewer ranks reporting: nobody is judged
    min_excess_s: float = 0.001  # compute seconds per step above the median below which no rank is slow


@dataclass(frozen=True)
class Reading:
    """One rank's mean compute seconds per step, as its node last reported it (``at``: the report's time)."""

    rank: int
    node: str
    compute_s: float
    at: float


@dataclass(frozen=True)
class RankScore:
    """A rank's score now: its compute time over the median's (``ratio``), and whether it is a straggler."""

    rank: int
    node: str
    compute_s: float
    ratio: float
    straggler: bool
    slow_since: Optional[float]  # when it last went above the threshold (None: below now)

    def to_dict(self) -> Dict[str, object]:
        return {"node": self.node, "compute_s": round(self.compute_s, 6), "ratio": round(self.ratio, 3),
                "straggler": self.straggler, "slow_since": self.slow_since}


@dataclass(frozen=True)
class Assessment:
    """Every judged rank's score and the straggler nodes (node -> its worst ratio)."""

    round: int
    median_s: Optional[float]
    ranks: Dict[int, RankScore]
    nodes: Dict[str, float]  # straggler nodes only
    flagged: List[str] = field(default_factory=list)  # nodes that became stragglers at this call
    cleared: List[str] = field(default_factory=list)  # nodes that stopped being stragglers at this call


def ratios(compute: Mapping[int, float]) -> Dict[int, float]:
    """Each rank's compute time over the median of all (empty with a median of 0 or no ranks)."""
    if not compute:
        return {}
    median = statistics.median(compute.values())
    if median <= 0:
        return {}
    return {rank: value / median for rank, value in compute.items()}


def fresh(readings: Sequence[Reading], now: float, stale_s: float) -> List[Reading]:
    """The readings not older than ``stale_s`` (and not from the future by more than that: a skewed clock)."""
    return [r for r in readings if abs(now - r.at) <= stale_s and r.compute_s >= 0]


class StragglerTracker:
    """Scores ranks reading by reading and keeps when each went above (or below) the threshold."""

    def __init__(self, policy: StragglerPolicy) -> None:
        self.policy = policy
        self.round = -1
        self._above: Dict[int, float] = {}  # rank -> since when its ratio has been >= threshold
        self._below: Dict[int, float] = {}  # flagged rank -> since when it has been below
        self._flagged: Set[int] = set()
        self._nodes: Set[str] = set()

    def observe(self, round_: int, readings: Sequence[Reading], now: float) -> Assessment:
        """Score ``readings`` (of round ``round_``) at time ``now``. A new round starts over: its ranks
        are other processes, possibly on other nodes."""
        p = self.policy
        if round_ != self.round:
            self.round, self._above, self._below, self._flagged = round_, {}, {}, set()
        latest = {r.rank: r for r in fresh(readings, now, p.stale_s)}
        if len(latest) < p.min_ranks:
            latest = {}
        scores = ratios({rank: r.compute_s for rank, r in latest.items()})
        median = statistics.median([r.compute_s for r in latest.values()]) if latest else None
        for rank in list(self._above):
            if rank not in scores:
                del self._above[rank]
        self._flagged &= set(scores)
        out: Dict[int, RankScore] = {}
        for rank, ratio in scores.items():
            slow = ratio >= p.threshold and latest[rank].compute_s - (median or 0.0) >= p.min_excess_s
            if slow:
                self._above.setdefault(rank, now)
                self._below.pop(rank, None)
                if now - self._above[rank] >= p.window_s:
                    self._flagged.add(rank)
            else:
                self._above.pop(rank, None)
                if rank in self._flagged:
                    since = self._below.setdefault(rank, now)
                    if now - since >= p.window_s:
                        self._flagged.discard(rank)
                        del self._below[rank]
            r = latest[rank]
            out[rank] = RankScore(rank, r.node, r.compute_s, ratio, rank in self._flagged, self._above.get(rank))
        nodes: Dict[str, float] = {}
        for s in out.values():
            if s.straggler:
                nodes[s.node] = max(nodes.get(s.node, 0.0), s.ratio)
        flagged = sorted(set(nodes) - self._nodes)
        cleared = sorted(self._nodes - set(nodes))
        self._nodes = set(nodes)
        return Assessment(round_, median, out, nodes, flagged, cleared)


@dataclass(frozen=True)
class DrainDecision:
    """Which node to drain now (None: none), and why not when there is a straggler but no drain."""

    node: Optional[str]
    reason: str


def drain_decision(assessment: Assessment, action: StragglerAction, members: Sequence[str], min_nodes: int,
                   draining: Sequence[str] = ()) -> DrainDecision:
    """The node ``--straggler-action drain`` removes now: the slowest straggler node, one at a time, never
    taking the job below ``min_nodes``, and none when half the nodes or more are slow (then the median
    itself is wrong: the job, not a node, is slow)."""
    if action is not StragglerAction.DRAIN or not assessment.nodes:
        return DrainDecision(None, "")
    if draining:
        return DrainDecision(None, f"node {draining[0]} is already leaving")
    slow = [n for n in assessment.nodes if n in members]
    if not slow:
        return DrainDecision(None, "")
    if 2 * len(slow) >= len(members):
        return DrainDecision(None, f"{len(slow)} of {len(members)} nodes are slow: not draining (a job-wide slowdown)")
    if len(members) - 1 < min_nodes:
        return DrainDecision(None, f"draining would leave {len(members) - 1} node(s), below the minimum {min_nodes}")
    worst = max(slow, key=lambda n: (assessment.nodes[n], n))
    return DrainDecision(worst, f"straggler: compute {assessment.nodes[worst]:.2f}× the job's median")


__all__ = ["Assessment", "DrainDecision", "RankScore", "Reading", "StragglerAction", "StragglerPolicy",
           "StragglerTracker", "drain_decision", "fresh", "ratios"]
