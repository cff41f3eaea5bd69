"""The agent's round loop: run our workers for one round until it ends.

    start   observer.round_started → in-place start (kept workers placed, or new ones started)
    turn    standby pre-warm → beat → outage guard → observer.tick → workers.poll
            → in-place tick (while they run) → hang watch                  ⇒ decide_workers
            → round change → failure rows (our step stood still) → in-place can_keep
                                                                           ⇒ decide_round
            → carry the action out: report and stop, keep the workers, or wait for a change

The decisions are pure (:mod:`elasticrun.launch.turn`); :class:`RoundLoop` gathers what they
read and carries their action out. Hang watch (:class:`~elasticrun.launch.hang.HangWatch`),
in-place re-forming (:class:`~elasticrun.launch.inplace.InPlaceRounds`), standby pre-warming
(:class:`~elasticrun.launch.standby.Standby`) and the observer
(:class:`~elasticrun.launch.observe.Observer`) are hooks the loop calls at those fixed points.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.hang import STACKS_WAIT_S, HangWatch, dump_stacks, hang_failures, hang_line
from elasticrun.launch.inplace import InPlaceRounds
from elasticrun.launch.observe import Observer
from elasticrun.launch.outage import OutageGuard, stop_workers
from elasticrun.launch.standby import Standby
from elasticrun.launch.stragglers import Drained
from elasticrun.launch.turn import (
    Action,
    Fenced,
    Hung,
    InPlaceFailed,
    JobSucceeded,
    KeepRunning,
    ReportSucceeded,
    RoundChanged,
    RoundSeen,
    Stall,
    WorkerFailed,
    WorkersEnd,
    WorkersSeen,
    decide_round,
    decide_workers,
    needs_failure_rows,
    wait_before_next_turn,
)
from elasticrun.launch.workers import SERVER_WAIT_S, GroupState, WorkerGroup
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import Topology, WorkerStatus
from elasticrun.rendezvous.states import RoundOutcome

HANG_STOP_S = 1.0  # SIGKILL after this: hung workers (and peers stuck with them) never reach a step boundary


class RoundLoop:
    """Our workers in round ``topo``: :meth:`start` them, then :meth:`run` until the round ends."""

    def __init__(self, cfg: LaunchConfig, rdzv: Rendezvous, workers: WorkerGroup, topo: Topology,
                 inplace: InPlaceRounds, obs: Observer, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.workers = workers
        self.topo = topo
        self.inplace = inplace
        self.obs = obs
        self.say = say
        self.guard = OutageGuard(cfg, rdzv, workers, say)
        self.hang: Optional[HangWatch] = None
        self.drain: Optional[Callable[[int], Optional[str]]] = None  # the straggler watch's drain_reason
        self.done_reported = False  # our workers' success is in etcd
        self._version = 0  # the view's version the next wait starts from

    # -- start --------------------------------------------------------------------------------

    def start(self) -> str:
        """Start (or place the kept) workers of the round; how, for the log."""
        topo = self.topo
        me = topo.member(self.cfg.rendezvous.node_id)
        assert me is not None
        event = self.rdzv.rescale_event(topo.round)
        ranks = f"{me.rank_offset}..{me.rank_offset + me.nproc - 1}"
        kind = event.type.value if event else "Start"
        self.say(
            f"round {topo.round} ({kind}): world size {topo.world_size}, {len(topo.members)} node(s), "
            f"group rank {me.group_rank}, ranks {ranks}, "
            f"restarts {topo.restart_count}/{self.cfg.rendezvous.max_restarts}"
        )
        self.rdzv.beat(busy_for=SERVER_WAIT_S)  # the start may wait for the fork server's imports (bounded)
        self.obs.round_started(topo, event)
        return self.inplace.start(self.rdzv, topo, me, event, self.guard.call)

    # -- the loop -----------------------------------------------------------------------------

    def run(self, how: str, hang: Optional[HangWatch]) -> RoundOutcome:
        """Watch the round (workers started ``how``; ``hang``: the ``--hang-timeout`` watch) until it ends."""
        rdzv = self.rdzv
        rdzv.beat()
        self.say(f"round {self.topo.round}: workers started ({how})")
        self.guard.call(lambda: rdzv.publish(status=WorkerStatus.ACTIVE, waiting_for=-1), "starting a round")
        self.hang = hang
        standby = Standby(lambda deep: self.workers.prewarm(deep=deep), time.monotonic())
        self._version = rdzv.view_version()
        while True:
            standby.turn(time.monotonic(), rdzv.scale_up_pending(self.topo))
            rdzv.beat()  # liveness: the lease is refreshed only while this loop turns
            reason = None if self.drain is None else self.drain(self.topo.round)
            if reason is not None:
                raise Drained(reason)  # the agent leaves as on SIGTERM (launch/stragglers.py)
            seen = self._look_at_workers()
            action = decide_workers(seen)
            if action is None:
                action = decide_round(self._look_at_round(seen.stall))
            outcome = self._do(action)
            if outcome is not None:
                return outcome

    def _look_at_workers(self) -> WorkersSeen:
        if self.guard.check(self.topo) is not None:  # lease in doubt: ride out an etcd outage, or fence
            return WorkersSeen(fenced=True, workers=self.workers.poll())
        self.obs.tick(self.rdzv, outage=self.guard.since is not None)
        state = self.workers.poll()
        running = state is GroupState.RUNNING
        inplace_failed = self.inplace.tick(self.rdzv, self.topo, self.guard.call) if running else None
        hang = self.hang
        if hang is not None and hang.carried is not None and self.inplace.during_inplace:
            hang.start_round(self.topo.round)  # re-forming: no step until the new round's first report
        stall = None if hang is None else Stall(hang.step, hang.stalled_for(), hang.timeout)
        return WorkersSeen(False, state, inplace_failed, stall, self.done_reported)

    def _look_at_round(self, stall: Optional[Stall]) -> RoundSeen:
        change = self.rdzv.round_change(self.topo)
        if change is None or change is RoundOutcome.SUCCEEDED:
            return RoundSeen(change)
        if self.inplace.finishes_first(self.rdzv, self.topo, time.monotonic()):
            return RoundSeen(None)  # our workers finish re-forming into this round first, then stay kept
        rows = self._failure_rows() if needs_failure_rows(stall) else []
        return RoundSeen(change, stall, rows, self.inplace.can_keep(self.rdzv, self.topo))

    def _failure_rows(self) -> List[Dict[str, Any]]:
        try:
            return self.rdzv.root_cause(self.topo.round)
        except (ElasticrunError, ValueError, TypeError):
            return []  # cannot tell: the graceful stop (SIGKILL after the grace) is the safe side

    # -- the actions --------------------------------------------------------------------------

    def _do(self, action: Action) -> Optional[RoundOutcome]:
        """Carry ``action`` out; how the round ended, or None to turn again."""
        if isinstance(action, KeepRunning):
            self._wait()
            return None
        if isinstance(action, ReportSucceeded):
            self._report_succeeded()
            return None
        if isinstance(action, JobSucceeded):
            self.guard.call(lambda: self.rdzv.mark_succeeded(self.topo), "finishing the job")
            stop_workers(self.rdzv, self.workers, self.cfg.workers.shutdown_timeout)
            return RoundOutcome.SUCCEEDED
        if isinstance(action, WorkerFailed):
            self._worker_failed()
        elif isinstance(action, InPlaceFailed):
            self.inplace.give_up(self.rdzv, self.topo, action.why, self.guard.call)
        elif isinstance(action, Hung):
            self._hung(action.stall)
        elif isinstance(action, RoundChanged):
            self._round_changed(action)
        else:
            assert isinstance(action, Fenced)  # the outage guard stopped our workers
        return RoundOutcome.NEXT

    def _wait(self) -> None:
        due = None if self.done_reported else self.rdzv.maybe_scale_up(self.topo)  # the leader's duty
        self._version = self.rdzv.wait_view(self._version, wait_before_next_turn(due, self.inplace.busy))

    def _report_succeeded(self) -> None:
        rdzv, topo = self.rdzv, self.topo
        self.guard.call(lambda: rdzv.report_done(topo), "reporting success")
        self.guard.call(lambda: rdzv.publish(status=WorkerStatus.SUCCEEDED), "reporting success")
        self.done_reported = True

    def _worker_failed(self) -> None:
        failures = self.workers.failures()
        first = failures[0]
        self.say(f"worker rank {first.rank} failed ({first.signal or first.exitcode}): stopping this round")
        self.obs.round_failed()
        self._report_failure(self.inplace.mark([f.to_dict() for f in failures]), "reporting a failure")  # in a re-form?
        stop_workers(self.rdzv, self.workers, self.cfg.workers.shutdown_timeout)

    def _hung(self, stall: Stall) -> None:
        self.say(f"round {self.topo.round}: the step reported by our workers (last {stall.step}) has not advanced "
                 f"for {stall.timeout:g} s: dumping every worker's Python stacks")
        self.obs.hang(self.topo, stall.step, stall.stalled_for)
        rows = self._dump_stacks(stall.timeout)
        self.say(f"{hang_line(rows, stall.timeout)}: stopping this round")
        self._report_failure(rows, "reporting a hang")
        stop_workers(self.rdzv, self.workers, HANG_STOP_S, sig=signal.SIGKILL)

    def _round_changed(self, action: RoundChanged) -> None:
        n = self.topo.round
        if action.stuck is not None:  # another node saw the hang; ours wait in the collective with it
            self.say(f"round {n}: our workers' step has not advanced for {action.stuck.stalled_for:.0f} s "
                     "either: dumping their Python stacks")
            self._report_failure(self._dump_stacks(action.stuck.timeout), "reporting a hang")
        keep = action.end is WorkersEnd.KEEP
        self.say(f"round {n} ended: {action.why}; " + ("workers keep training until they re-form in place"
                                                       if keep else "stopping workers"))
        self.obs.round_changed(self.rdzv, self.topo)
        if keep:
            self.inplace.carry(n, failed=self.rdzv.round_failed(n), broken=self.rdzv.collectives_broke(n))
        elif action.end is WorkersEnd.KILL:
            stop_workers(self.rdzv, self.workers, HANG_STOP_S, sig=signal.SIGKILL)
        else:
            stop_workers(self.rdzv, self.workers, self.cfg.workers.shutdown_timeout)

    def _dump_stacks(self, timeout: float) -> List[Dict[str, Any]]:
        """Have our running workers dump their stacks to the log; the hang's failure rows."""
        workers_now = self.workers.running
        self.rdzv.beat(busy_for=STACKS_WAIT_S)
        dump_stacks(workers_now)
        return hang_failures(workers_now, timeout)

    def _report_failure(self, rows: List[Dict[str, Any]], what: str) -> None:
        self.guard.call(lambda: self.rdzv.report_failure(self.topo, rows), what)


__all__ = ["HANG_STOP_S", "RoundLoop"]
