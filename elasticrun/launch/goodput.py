"""Goodput accounting: how much of a node's wall time became training that was kept.

Pure logic, fed by the agent (phase transitions) and by the workers' progress reports
(step, cumulative checkpoint stall); the clock is injectable so tests drive it.

Definitions (docs/observability.md):

- wall time: since the accounting started (the agent started), split into phases
  (:class:`Phase`); every second is in exactly one phase;
- goodput: seconds in ``training`` spent on steps that were kept;
- badput: every other second, by cause (:class:`Cause`): ``startup`` (rendezvous and start
  before the first training), ``restart`` and ``rescale`` (stopping, re-forming and starting
  again after a worker failure or a membership change), ``rollback`` (training time of steps
  that a restore threw away), ``checkpoint_stall`` (training blocked on a checkpoint or
  snapshot, as the workers report it), ``outage`` (etcd unreachable), ``shutdown`` (after the
  last reported step of a job that ended: workers exiting, the agent finishing), ``hang``
  (``--hang-timeout`` fired: the training time since the last reported step, and stopping,
  re-forming and starting again after it — a cause of its own, not ``restart``, so an operator
  sees hangs apart from crashes); ``node_check`` (``--node-check`` before joining), ``drain``
  (re-forming after a straggler's node was drained, instead of ``rescale``) and ``straggler``
  (while a straggler is flagged, 1 − 1/ratio of training time: the share the others spent waiting
  for it; it stays in the training phase, like ``rollback``, and is no goodput);
- rollback: when a round resumed from step S (the step its workers report they restored, else
  its first report's step) after the job had reached step T > S (the last step the workers
  reached, which they keep on the node, else the highest reported), the training time from
  when step S was first reached until training stopped is moved from goodput to ``rollback``,
  and T - S steps are counted as lost;
- ``unknown``: until the script's first progress report (ever, on this node) the agent cannot
  tell start-up from training: the time in ``starting`` stays unattributed, and becomes the
  round's cause (``startup``, ``restart``, ...) at the first report, or ``unknown`` when the
  round ends without one. A script that never reports (an unmodified one) is ``unknown`` after
  each (re)start, never ``restart`` or ``startup``.

Invariant: ``goodput_s + sum(badput.values()) == wall_s``.

Two views. :meth:`Goodput.summary` is the refined account (seconds moved between phases as
stalls, rollbacks and tails become known; what ``status`` shows). :meth:`Goodput.counters` is
what Prometheus gets, where a counter must never go down: the phases as they were lived (a
training second stays training) and, as their own series, the training seconds later found not
kept (:attr:`Goodput.lost`: rollback, checkpoint_stall, shutdown, hang) — productive, then lost;
goodput is the one minus the other. A progress report is dated back at most
:data:`REPORT_LAG_S`, and the counters show ``starting`` time that much late, so that dating a
report back never takes seconds away from a counter.
"""

from __future__ import annotations

import bisect
import enum
import time
from typing import Callable, Dict, List, Optional, Tuple


class Phase(str, enum.Enum):
    """What a node is doing at a moment of wall time."""

    RENDEZVOUS = "rendezvous"  # forming a round
    STARTING = "starting"  # workers started, no progress report of this round yet
    TRAINING = "training"  # workers report steps
    RESTARTING = "restarting"  # a worker failed: stopping the round
    RESCALING = "rescaling"  # membership changed: stopping the round
    CHECKPOINT_STALL = "checkpoint_stall"  # training blocked on a checkpoint/snapshot (reported by workers)
    OUTAGE = "outage"  # etcd unreachable
    FINISHING = "finishing"  # the job's end: from the last reported step until the agent is done


class Cause(str, enum.Enum):
    """Why a second was not goodput."""

    STARTUP = "startup"
    RESTART = "restart"
    RESCALE = "rescale"
    ROLLBACK = "rollback"
    CHECKPOINT_STALL = "checkpoint_stall"
    OUTAGE = "outage"
    SHUTDOWN = "shutdown"
    HANG = "hang"
    NODE_CHECK = "node_check"  # --node-check before joining
    DRAIN = "drain"  # re-forming because a straggler's node was drained (--straggler-action drain)
    STRAGGLER = "straggler"  # training time lost waiting for a straggler: (1 - 1/ratio) of it
    UNKNOWN = "unknown"  # starting time of a script that has not reported progress yet


REPORT_LAG_S = 2.0  # a progress report is dated back at most this far (it is read once a second)

LOST_CAUSES = (Cause.ROLLBACK, Cause.CHECKPOINT_STALL, Cause.SHUTDOWN, Cause.HANG, Cause.STRAGGLER)
_NOT_KEPT = (Cause.ROLLBACK, Cause.STRAGGLER)  # training seconds that stay in the training phase but are no goodput
_FIXED_CAUSE = {Phase.RESCALING: Cause.RESCALE,  # restarting: the cause given (restart or hang)
                Phase.CHECKPOINT_STALL: Cause.CHECKPOINT_STALL, Phase.OUTAGE: Cause.OUTAGE,
                Phase.FINISHING: Cause.SHUTDOWN}


class Goodput:
    """One node's accounting. Not thread-safe: the caller holds a lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.phase = Phase.RENDEZVOUS
        self.cause = Cause.STARTUP  # what rendezvous/starting time is charged to now
        self._since = self.started
        self.phase_seconds: Dict[Phase, float] = {p: 0.0 for p in Phase}
        self.badput: Dict[Cause, float] = {c: 0.0 for c in Cause}
        self.lived: Dict[Phase, float] = {p: 0.0 for p in Phase}  # as lived: never moved afterwards
        self.lost: Dict[Cause, float] = {c: 0.0 for c in LOST_CAUSES}  # training seconds found not kept
        self.reported = False  # the script reported progress at least once
        self._unsettled = 0.0  # starting seconds before the script's first report: cause not known yet
        self._resume = Phase.STARTING  # the phase an outage returns to
        self.steps_lost = 0
        self.step: Optional[int] = None  # latest reported step
        self.high_step: Optional[int] = None  # highest step the job reached (kept so far)
        self._training = 0.0  # cumulative training seconds (before rollback), the x of _history
        self._history: List[Tuple[int, float]] = []  # (step, _training when first reached), steps increasing
        self._fresh_round = False  # the next report is the first of a round
        self._stall_seen = 0.0  # the current round's cumulative stall already accounted
        self._last_report = 0.0  # _training at the latest report
        self.finished = False
        self._slow = 0.0  # the share of training time lost to a straggler right now (0: none)

    # -- feeding ----------------------------------------------------------------------------

    def enter(self, phase: Phase, cause: Optional[Cause] = None) -> None:
        """Wall time from now on is in ``phase``; ``cause`` (if given) is what rendezvous and
        start-up time is charged to from now on (restart, rescale). For an etcd outage use
        :meth:`outage`."""
        self._flush()
        if phase not in (Phase.STARTING, Phase.TRAINING, Phase.OUTAGE):
            self._settle(Cause.UNKNOWN)  # the round ended before the script's first report
        if cause is not None:
            self.cause = cause
        if phase is Phase.STARTING:
            self._fresh_round = True
            self._stall_seen = 0.0
        self.phase = phase

    def outage(self, on: bool) -> None:
        """etcd stopped (``on``) or started again answering: ``outage`` until it answers, then back
        to the phase it interrupted (training, if the round's first report came meanwhile)."""
        if on == (self.phase is Phase.OUTAGE):
            return
        self._flush()
        if on:
            self._resume, self.phase = self.phase, Phase.OUTAGE
        else:
            self.phase = self._resume

    def report(self, step: int, stall_s: float = 0.0, at: Optional[float] = None, *,
               restored: Optional[int] = None, reached: Optional[int] = None) -> None:
        """A progress report of the current round: latest ``step`` and the round's cumulative
        checkpoint/snapshot stall ``stall_s``, made at clock time ``at`` (default: now; a report
        read late is dated back to when it was made). The first one of a round starts ``training``.
        ``restored``: the step the round's workers resumed from; ``reached``: the last step the
        previous round's workers reached on this node (both as the reporter knows them, see
        :func:`rollback_marks`) — the rollback is counted from them rather than from the round's
        first report and the last one seen, which are up to a report interval off each."""
        if self.finished:
            return
        now = self.clock()
        at = now if at is None else min(now, max(at, self._since, now - REPORT_LAG_S))
        if self.phase is Phase.STARTING:
            self._flush(at)
            self.phase = Phase.TRAINING
        elif self.phase is Phase.OUTAGE and self._resume is Phase.STARTING:
            self._resume = Phase.TRAINING
        self._flush(now)
        if not self.reported:
            self.reported = True
            self._settle(self.cause)  # the round's start-up was start-up (or restart...) after all
        self._stall(stall_s - self._stall_seen)  # it happened before this report
        self._stall_seen = max(self._stall_seen, stall_s)
        reached_at = self._training - ((now - at) if self.phase is Phase.TRAINING else 0.0)
        if self._fresh_round:
            self._fresh_round = False
            base = step if restored is None else min(step, restored)
            if reached is not None and (self.high_step is None or reached > self.high_step):
                self._history.append((reached, reached_at))  # reached by the time training stopped
                self.high_step = reached
            if self.high_step is not None and base < self.high_step:
                self.steps_lost += self.high_step - base
                self._rollback(base, reached_at)
        self._last_report = reached_at
        if self.high_step is None or step > self.high_step:
            self._history.append((step, reached_at))
            self.high_step = step
        self.step = step

    def finish(self) -> None:
        """The job ended: the clock stops here. Training time after the last report trained no
        reported step: it moves to ``finishing`` (cause ``shutdown``)."""
        self._flush()
        self._settle(Cause.UNKNOWN)
        if self.phase is Phase.TRAINING:
            self._move_tail(Phase.FINISHING, Cause.SHUTDOWN)
            self.phase = Phase.FINISHING
        self.finished = True

    def hang(self) -> None:
        """``--hang-timeout`` fired: the training time since the last report trained nothing and
        moves to ``restarting`` (cause ``hang``), as does the stopping and re-forming from now on."""
        self._flush()
        if self.phase is Phase.TRAINING:
            self._move_tail(Phase.RESTARTING, Cause.HANG)
        self.enter(Phase.RESTARTING, Cause.HANG)

    def slowed(self, ratio: Optional[float]) -> None:
        """The job's slowest rank computes ``ratio`` × the median's (None or <= 1: no straggler): from now on
        that share, 1 - 1/ratio, of training time is badput of cause ``straggler`` (the others wait for it)."""
        self._flush()
        self._slow = 0.0 if ratio is None or ratio <= 1 else 1.0 - 1.0 / ratio

    def _move_tail(self, phase: Phase, cause: Cause) -> None:
        tail = min(max(0.0, self._training - self._last_report), self.phase_seconds[Phase.TRAINING])
        self.phase_seconds[Phase.TRAINING] -= tail
        self._training -= tail
        self.phase_seconds[phase] += tail
        self.badput[cause] += tail
        self.lost[cause] += tail

    # -- reading ----------------------------------------------------------------------------

    def totals(self) -> Tuple[Dict[Phase, float], Dict[Cause, float]]:
        """(seconds by phase, badput by cause) up to now, refined (see :meth:`summary`), without
        moving the accounting's clock; starting time of a script that never reported is ``unknown``."""
        phases, badput = dict(self.phase_seconds), dict(self.badput)
        pending = self._pending()
        phases[self.phase] += pending
        badput[Cause.UNKNOWN] += self._unsettled
        if self.phase is not Phase.TRAINING:
            badput[self._charged()] += pending
        return phases, badput

    def counters(self) -> Dict[str, Dict[str, float]]:
        """What Prometheus gets: series that never go down. ``phase_s``: seconds by phase as lived
        (no ``checkpoint_stall``: that is found in training afterwards); ``badput_s``: by cause,
        what is settled (starting time before the first report is not, until it is); ``lost_s``:
        training seconds found afterwards not kept, by cause. Goodput = training - sum(lost)."""
        lived, badput = dict(self.lived), dict(self.badput)
        pending = self._pending()
        if self.phase is Phase.STARTING:
            pending = max(0.0, pending - REPORT_LAG_S)  # a report may still date training back that far
        lived[self.phase] += pending
        if self.phase is not Phase.TRAINING and (self.phase is not Phase.STARTING or self.reported):
            badput[self._charged()] += pending
        return {"phase_s": {p.value: round(v, 3) for p, v in lived.items() if p is not Phase.CHECKPOINT_STALL},
                "badput_s": {c.value: round(v, 3) for c, v in badput.items()},
                "lost_s": {c.value: round(v, 3) for c, v in self.lost.items()}}

    @property
    def wall_s(self) -> float:
        return sum(self.totals()[0].values())

    @property
    def goodput_s(self) -> float:
        phases, badput = self.totals()
        return max(0.0, phases[Phase.TRAINING] - sum(badput[c] for c in _NOT_KEPT))

    @property
    def ratio(self) -> float:
        """Goodput over wall time (0 before any time passed)."""
        wall = self.wall_s
        return self.goodput_s / wall if wall > 0 else 0.0

    def summary(self) -> Dict[str, object]:
        """A JSON-able snapshot (what the agent publishes and ``status`` aggregates); read-only."""
        phases, badput = self.totals()
        wall = sum(phases.values())
        good = max(0.0, phases[Phase.TRAINING] - sum(badput[c] for c in _NOT_KEPT))
        return {
            "wall_s": round(wall, 3),
            "goodput_s": round(good, 3),
            "goodput_ratio": round(good / wall, 5) if wall > 0 else 0.0,
            "badput_s": {c.value: round(v, 3) for c, v in badput.items()},
            "phase_s": {p.value: round(v, 3) for p, v in phases.items()},
            "phase": self.phase.value,
            "cause": None if self.phase is Phase.TRAINING else self._charged().value,  # of the time from now
            "finished": self.finished,
            "steps_lost": self.steps_lost,
            "step": self.step,
        }

    # -- internals --------------------------------------------------------------------------

    def _pending(self) -> float:
        return 0.0 if self.finished else max(0.0, self.clock() - self._since)

    def _charged(self) -> Cause:
        """What a second of the current (non-training) phase is charged to."""
        if self.phase is Phase.STARTING and not self.reported:
            return Cause.UNKNOWN
        return self._cause_of(self.phase)

    def _cause_of(self, phase: Phase) -> Cause:
        """A phase's fixed cause; re-forming after a drain is ``drain``'s, not ``rescale``'s."""
        fixed = _FIXED_CAUSE.get(phase, self.cause)
        return self.cause if fixed is Cause.RESCALE and self.cause is Cause.DRAIN else fixed

    def _flush(self, now: Optional[float] = None) -> None:
        now = self.clock() if now is None else now
        dt = 0.0 if self.finished else max(0.0, now - self._since)
        self._since = now
        if not dt:
            return
        self.phase_seconds[self.phase] += dt
        self.lived[self.phase] += dt
        if self.phase is Phase.TRAINING:
            self._training += dt
            if self._slow:
                self.badput[Cause.STRAGGLER] += dt * self._slow
                self.lost[Cause.STRAGGLER] += dt * self._slow
        elif self.phase is Phase.STARTING and not self.reported:
            self._unsettled += dt
        else:
            self.badput[self._cause_of(self.phase)] += dt

    def _settle(self, cause: Cause) -> None:
        """The unattributed starting seconds are ``cause``'s."""
        self.badput[cause] += self._unsettled
        self._unsettled = 0.0

    def _stall(self, seconds: float) -> None:
        """Move ``seconds`` of training (a worker-reported stall) to ``checkpoint_stall``."""
        seconds = min(max(0.0, seconds), self.phase_seconds[Phase.TRAINING])
        if seconds <= 0:
            return
        self.phase_seconds[Phase.TRAINING] -= seconds
        self.phase_seconds[Phase.CHECKPOINT_STALL] += seconds
        self.badput[Cause.CHECKPOINT_STALL] += seconds
        self.lost[Cause.CHECKPOINT_STALL] += seconds
        self._training -= seconds

    def _rollback(self, step: int, now_training: float) -> None:
        """The round restarted from ``step`` below the high mark: training from when ``step`` was reached
        until the previous round stopped (``now_training`` minus this round's) is lost."""
        steps = [s for s, _ in self._history]
        i = bisect.bisect_left(steps, step)  # the first point at or after ``step``
        if i == len(steps):
            return
        reached = self._history[i][1]
        if i > 0 and steps[i] != step:  # interpolate between the neighbours
            s0, t0 = self._history[i - 1]
            s1, t1 = self._history[i]
            reached = t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        lost = max(0.0, now_training - reached)
        lost = min(lost, self.phase_seconds[Phase.TRAINING] - self.badput[Cause.ROLLBACK])
        self.badput[Cause.ROLLBACK] += lost
        self.lost[Cause.ROLLBACK] += lost
        del self._history[i:]
        self.high_step = None if not self._history else self._history[-1][0]


def rollback_marks(report: Dict[str, object]) -> Dict[str, Optional[int]]:
    """``restored`` and ``reached`` of a progress report (``elasticrun.train.ProgressReporter``) for
    :meth:`Goodput.report`; a missing or malformed one is None (the report's own step is used)."""
    def step(key: str) -> Optional[int]:
        v = report.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    return {"restored": step("restored"), "reached": step("reached")}


def aggregate(summaries: List[Dict[str, object]]) -> Dict[str, object]:
    """The job's figures from its nodes' summaries: node-seconds summed (each node counts its own wall time)."""
    wall = sum(float(s.get("wall_s") or 0.0) for s in summaries)  # type: ignore[arg-type]
    good = sum(float(s.get("goodput_s") or 0.0) for s in summaries)  # type: ignore[arg-type]
    badput: Dict[str, float] = {c.value: 0.0 for c in Cause}
    for s in summaries:
        for cause, v in dict(s.get("badput_s") or {}).items():  # type: ignore[call-overload]
            badput[str(cause)] = badput.get(str(cause), 0.0) + float(v)
    top = sorted(((c, v) for c, v in badput.items() if v > 0), key=lambda cv: -cv[1])
    return {
        "nodes": len(summaries),
        "wall_s": round(wall, 3),
        "goodput_s": round(good, 3),
        "goodput_ratio": round(good / wall, 5) if wall > 0 else None,
        "badput_s": {c: round(v, 3) for c, v in badput.items()},
        "top_badput": [{"cause": c, "seconds": round(v, 3), "share": round(v / wall, 5)} for c, v in top[:3]],
        "steps_lost": max((int(s.get("steps_lost") or 0) for s in summaries), default=0),  # type: ignore[call-overload]
    }


__all__ = ["LOST_CAUSES", "REPORT_LAG_S", "Cause", "Goodput", "Phase", "aggregate", "rollback_marks"]
