"""The agent's side of in-place re-forming (the workers' side is :mod:`elasticrun.train.inplace`).

    opt-in reported → round ends (join, graceful leave) → workers kept → next round formed
      survivor: newcomers ready? → write assignments → workers re-formed?   (else: restart path)
      newcomer: start workers with ELASTICRUN_REFORM_JOIN=1 → their ``.ready`` files → ``ready/<node>``

An agent keeps its workers through a round change only when every local worker opted in
(``<reform file>.optin``), the round did not fail, no hang was seen and the workers still run.
The leader decides from the node records who re-forms (:func:`~elasticrun.rendezvous.inplace.plan_inplace`,
``Topology.inplace``); a kept worker the new round does not re-form in place is stopped and
restarted as today. A newcomer not ready within ``--inplace-ready-timeout``, or a survivor that
has not re-formed :data:`REFORM_DEADLINE_S` after its assignment (or exits 75), ends the round
as a worker failure: today's restart path.

A graceful leave (SIGTERM to the agent) of a node whose workers opted in leaves the job *first*
(:meth:`InPlaceRounds.leave_first`): SIGTERM to the workers, the ``left`` marker, the lease revoked,
and only then the wait for the workers to exit. The survivors' round forms while the leaver's
workers are still shutting down; those left the old group at the same step boundary as everyone
(their ``check()`` returns STOP), and their round is stale at once, so the commit fence refuses
any save they attempt.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.job import env as names
from elasticrun.job import reform
from elasticrun.job.reform import REFORM_DEADLINE_S
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.failures import make_failure
from elasticrun.launch.outage import stop_workers
from elasticrun.launch.workers import GroupState, WorkerGroup
from elasticrun.proc import kill_process_group
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import Member, RescaleEvent, Topology

#: How an etcd operation of the in-place work runs: ``call(fn, what)`` returns ``fn()``. The agent
#: passes its outage guard's :meth:`~elasticrun.launch.outage.OutageGuard.call`, so a write that
#: meets an etcd outage is retried up to ``--etcd-outage-grace`` like the restart path's.
EtcdCall = Callable[[Callable[[], Any], str], Any]


def direct(fn: Callable[[], Any], what: str) -> Any:  # noqa: ARG001 - the EtcdCall signature
    """An :data:`EtcdCall` without a guard: the operation runs once."""
    return fn()


class InPlaceRounds:
    """Per agent: keeps workers through planned rescales and places them in the next round."""

    def __init__(self, cfg: LaunchConfig, workers: WorkerGroup, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.enabled = cfg.inplace
        self.workers = workers
        workers.inplace = cfg.inplace
        self.say = say
        self.carrying = False  # workers kept through a round change, not yet placed in the next round
        self._told = False  # our node record says inplace=True
        self._round = -1  # the round our survivors re-form for (-1: none pending)
        self._envs: List[dict] = []
        self._published = 0.0  # when the assignments were written (0: not yet)
        self._deadline = 0.0
        self._joining = -1  # the round our newcomer workers join (-1: none)
        self._forming = -1  # that round until our newcomer workers have the state (-1: none)

    @property
    def busy(self) -> bool:
        """A re-form or a newcomer's start is under way: the agent loop should turn often."""
        return self._round >= 0 or self._joining >= 0

    def _files(self) -> List[str]:
        return [self.workers.reform_file(w.spec.local_rank) for w in self.workers.running]

    def before_round(self, rdzv: Rendezvous) -> None:
        """Before waiting for the next round: a node whose workers stopped no longer offers in-place."""
        if self._told and not self.carrying:
            rdzv.publish(inplace=False)
            self._told = False

    def drop(self) -> None:
        """Stop workers kept through a round change (our lease was lost: no re-form, no stale worker)."""
        if self.carrying:
            self.carrying = False
            self.workers.stop(self.cfg.shutdown_timeout)

    def start(self, rdzv: Rendezvous, topo: Topology, me: Member, event: Optional[RescaleEvent],
              call: EtcdCall = direct) -> str:
        """Place the kept workers in ``topo`` or start new ones; how, for the agent's log line."""
        if self.carrying:
            self.carrying = False
            if me.node_id in topo.inplace:
                self._envs = self.workers.adopt(topo, me, event)
                self._joining = self._forming = -1
                self._round, self._published = topo.round, 0.0
                self._deadline = time.monotonic() + self.cfg.inplace_ready_timeout
                return f"{len(self._envs)} kept, re-forming in place"
            self.say(f"round {topo.round} restarts every worker: stopping the kept ones")
            self.workers.stop(self.cfg.shutdown_timeout)
            call(lambda: rdzv.publish(inplace=False), "starting a round")
            self._told = False
        self._round = -1  # fresh workers: nothing of an earlier re-form is pending
        for local_rank in range(me.nproc):
            reform.clear(self.workers.reform_file(local_rank))
        join = self.enabled and bool(topo.inplace) and me.node_id not in topo.inplace
        if join:
            self.workers.extra_env[names.REFORM_JOIN] = "1"
        try:
            self.workers.start(topo, me, event)
        finally:
            self.workers.extra_env.pop(names.REFORM_JOIN, None)
        self._joining = self._forming = topo.round if join else -1
        self._deadline = time.monotonic() + self.cfg.inplace_ready_timeout
        return self.workers.started_how + (", joining in-place survivors" if join else "")

    @property
    def in_reform(self) -> bool:
        """Our workers are inside an in-place re-form: survivors between their assignment and re-forming,
        newcomers until they have received the state."""
        return (self._round >= 0 and bool(self._published)) or self._forming >= 0

    def mark(self, rows: List[dict]) -> List[dict]:
        """Failure rows of our workers, flagged :data:`~elasticrun.job.reform.IN_REFORM` when they failed
        inside the re-form (the restart that follows is then not charged to ``--max-restarts``)."""
        if self.in_reform:
            for row in rows:
                row[reform.IN_REFORM] = True
        return rows

    def leave_first(self, rdzv: Rendezvous, round_: int, sig: int) -> bool:
        """Graceful leave of round ``round_``: signal our workers, mark the leave and revoke our lease
        without waiting for the workers to exit. True once the workers were signalled: the caller must
        not signal them again (a second SIGTERM kills); False: nothing done, the caller leaves as before."""
        if not (self.enabled and round_ >= 0 and sig == signal.SIGTERM) or self.busy or self.carrying:
            return False
        files = self._files()  # opted in, even if the next tick would only now say so in our node record
        if rdzv.lease is None or not files or not all(reform.opted_in(f) for f in files):
            return False
        for pid in self.workers.pids:
            kill_process_group(pid, sig)  # InPlace.check() turns it into STOP at the next step boundary
        try:
            rdzv.mark_left(round_)  # before the lease goes: the leader plans the survivors' re-form on it
            rdzv.leave()  # the survivors' next round forms now, not once our workers have exited
        except ElasticrunError:
            pass  # etcd unreachable: the caller's own leave (lease still held) tries again
        return True

    def keep(self, rdzv: Rendezvous, topo: Topology) -> bool:
        """At the end of round ``topo``: True to keep our workers for the next round (no stop)."""
        if not (self.enabled and self._told) or self.busy:
            return False
        if rdzv.round_failed(topo.round):
            return False
        if self.workers.poll() is not GroupState.RUNNING:
            return False
        self.carrying = True
        return True

    def tick(self, rdzv: Rendezvous, topo: Topology, call: EtcdCall = direct) -> bool:
        """One turn of the agent loop; True when a re-form failed and the restart path was taken.
        Every etcd write goes through ``call`` (the agent's outage guard)."""
        if not self.enabled:
            return False
        files = self._files()
        if not self._told and files and not self.busy and all(reform.opted_in(f) for f in files):
            call(lambda: rdzv.publish(inplace=True), "offering in-place re-forming")
            self._told = True
        now = time.monotonic()
        if self._forming >= 0 and files and all(reform.formed_round(f) >= self._forming for f in files):
            self._forming = -1  # our newcomers received the state: a failure from now on is the round's
        if self._joining >= 0:
            if files and all(reform.ready(f) or reform.formed_round(f) >= self._joining for f in files):
                key = rdzv.keys.ready(self._joining, rdzv.node_id)
                call(lambda: rdzv.store.put_json(key, {"time": time.time()}), "telling the survivors we are ready")
                self._joining = -1
            elif now > self._deadline:
                self._joining = -1  # the survivors give up on us: their round fails
        if self._round < 0:
            return False
        if not self._published:
            need = [m.node_id for m in topo.members if m.node_id not in topo.inplace]
            have = rdzv.view.under(rdzv.keys.readies(self._round))
            if all(rdzv.keys.ready(self._round, n) in have for n in need):
                for w, env in zip(self.workers.running, self._envs):
                    reform.write_assignment(self.workers.reform_file(w.spec.local_rank), env)
                self._published = now
                self._deadline = now + REFORM_DEADLINE_S
                return False
            if now > self._deadline:
                wait = self.cfg.inplace_ready_timeout
                return self._fail(rdzv, topo, f"newcomers {', '.join(need)} not ready within {wait:g} s", call)
            return False
        if all(reform.formed_round(f) >= self._round for f in files):
            self.say(f"round {self._round}: workers re-formed in place in {now - self._published:.2f} s")
            self._round = -1
        elif now > self._deadline:
            return self._fail(rdzv, topo, f"workers did not re-form within {REFORM_DEADLINE_S:g} s", call)
        return False

    def _fail(self, rdzv: Rendezvous, topo: Topology, why: str, call: EtcdCall) -> bool:
        self.say(f"round {topo.round}: in-place re-form failed ({why}): restarting the round")
        rows = [make_failure(w.spec.member.node_id, w.spec.member.host, w.spec.rank, w.spec.local_rank,
                             reform.EXIT_REFORM_FAILED, w.spec.error_file).to_dict() for w in self.workers.running]
        self._round = -1
        call(lambda: rdzv.report_failure(topo, rows), "reporting a failed re-form")
        stop_workers(rdzv, self.workers, 1.0, sig=signal.SIGKILL)  # a half-made group: no graceful stop
        return True


__all__ = ["EtcdCall", "InPlaceRounds", "direct"]
