"""The agent's side of in-place re-forming (the workers' side is :mod:`elasticrun.train.inplace`).

    opt-in reported → round ends (join, graceful leave) → workers kept → next round formed
      survivor: newcomers ready? → write assignments → workers re-formed?   (else: restart path)
      newcomer: start workers with ELASTICRUN_INPLACE_JOIN=1 → their ``.ready`` files → ``ready/<node>``

An agent keeps its workers through a round change only when every local worker opted in
(``<in-place file>.optin``), no hang was seen, the workers still run, and the round did not fail or
failed only by other nodes' crashes flagged recoverable in place (:meth:`InPlaceRounds.mark` flags
a crashed node's rows when its workers had all opted in, outside any re-form). Kept workers are told
(``<in-place file>.recover``): one whose collective broke waits in ``InPlace.recover`` for its next
assignment; the crashed node starts its workers again as newcomers.
The leader decides from the node records who re-forms (:func:`~elasticrun.rendezvous.inplace.plan_inplace`,
``Topology.inplace``); a kept worker the new round does not re-form in place is stopped and
restarted as today. A newcomer not ready within ``--inplace-ready-timeout``, or a survivor that
has not re-formed :data:`INPLACE_DEADLINE_S` after its assignment (or exits 75), ends the round
as a worker failure: today's restart path.

A graceful leave (SIGTERM to the agent) of a node whose workers opted in leaves the job *first*
(:meth:`InPlaceRounds.leave_first`): SIGTERM to the workers, the ``left`` marker, the lease revoked,
and only then the wait for the workers to exit. The survivors' round forms while the leaver's
workers are still shutting down; those left the old group at the same step boundary as everyone
(their ``check()`` returns STOP), and their round is stale at once, so the commit fence refuses
any save they attempt.

While the workers run, the round loop calls :meth:`InPlaceRounds.tick` each turn: it reads the
files and records it needs, :func:`inplace_steps` (pure) says what to do, and the tick does it; a
re-form that failed is handed back to the loop, which decides when to take the restart path.
"""

from __future__ import annotations

import enum
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.job import env as names
from elasticrun.job import inplace
from elasticrun.job.inplace import INPLACE_DEADLINE_S
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.failures import make_failure
from elasticrun.launch.hang import STACKS_WAIT_S, dump_stacks
from elasticrun.launch.outage import stop_workers
from elasticrun.launch.workers import GroupState, WorkerGroup
from elasticrun.proc import kill_process_group
from elasticrun.rendezvous.inplace import keeps_through_failure
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import Member, RescaleEvent, Topology

#: How long the end of a round for newcomers waits for our kept workers to finish re-forming into it (they
#: take well under a second once their assignments are written; past this, the restart path).
FINISH_FIRST_S = 15.0

#: How an etcd operation of the in-place work runs: ``call(fn, what)`` returns ``fn()``. The round loop
#: passes its outage guard's :meth:`~elasticrun.launch.outage.OutageGuard.call`, so a write that meets
#: an etcd outage is retried up to ``--etcd-outage-grace`` like the restart path's.
EtcdCall = Callable[[Callable[[], Any], str], Any]


def direct(fn: Callable[[], Any], what: str) -> Any:  # noqa: ARG001 - the EtcdCall signature
    """An :data:`EtcdCall` without a guard: the operation runs once."""
    return fn()


class InPlaceRounds:
    """Per agent: keeps workers through planned rescales and places them in the next round."""

    def __init__(self, cfg: LaunchConfig, workers: WorkerGroup, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.enabled = cfg.rendezvous.inplace
        self.workers = workers
        workers.inplace = cfg.rendezvous.inplace
        self.say = say
        self.carrying = False  # workers kept through a round change, not yet placed in the next round
        self._told = False  # our node record says inplace=True
        self._reforming = -1  # the round our survivors re-form for (-1: none pending)
        self._envs: List[dict] = []
        self._published = 0.0  # when the assignments were written (0: not yet)
        self._deadline = 0.0
        self._joining = -1  # the round our newcomer workers join (-1: none)
        self._forming = -1  # that round until our newcomer workers have the state (-1: none)
        self._recovering = False  # our kept workers wait in InPlace.recover (the round ended by a crash)
        self._crashed = False  # our workers crashed, recoverably in place: we may sit the next round out
        self._finish_since: Optional[float] = None  # when a round end began to wait for our re-form

    @property
    def busy(self) -> bool:
        """A re-form or a newcomer's start is under way: the agent loop should turn often."""
        return self._reforming >= 0 or self._joining >= 0

    def _files(self) -> List[str]:
        return [self.workers.inplace_file(w.spec.local_rank) for w in self.workers.running]

    def before_round(self, rdzv: Rendezvous) -> None:
        """Before waiting for the next round: a node whose workers stopped no longer offers in-place; one
        whose workers crashed recoverably offers to sit the round out (the survivors re-form at once)."""
        if self._told and not self.carrying:
            rdzv.publish(inplace=False)
            self._told = False
        if self._crashed:  # (a retry after an etcd outage must not take the offer back)
            rdzv.sit_out_next, self._crashed = True, False

    def drop(self) -> None:
        """Stop workers kept through a round change (our lease was lost: no re-form, no stale worker)."""
        if self.carrying:
            self.carrying = False
            self.workers.stop(self.cfg.workers.shutdown_timeout)

    def start(self, rdzv: Rendezvous, topo: Topology, me: Member, event: Optional[RescaleEvent],
              call: EtcdCall = direct) -> str:
        """Place the kept workers in ``topo`` or start new ones; how, for the agent's log line."""
        if self.carrying:
            self.carrying = False
            if me.node_id in topo.inplace:
                self._envs = self.workers.adopt(topo, me, event)
                self._reforming, self._published = topo.round, 0.0
                self._joining = self._forming = -1
                self._deadline = time.monotonic() + self.cfg.rendezvous.inplace_ready_timeout
                return f"{len(self._envs)} kept, re-forming in place"
            self.say(f"round {topo.round} restarts every worker: stopping the kept ones")
            self.workers.stop(self.cfg.workers.shutdown_timeout)
            call(lambda: rdzv.publish(inplace=False), "starting a round")
            self._told = False
        self._reforming, self._recovering = -1, False  # fresh workers: nothing of an earlier re-form is pending
        for local_rank in range(me.nproc):
            inplace.clear(self.workers.inplace_file(local_rank))
        join = self.enabled and bool(topo.inplace) and me.node_id not in topo.inplace
        if join:
            self.workers.extra_env[names.INPLACE_JOIN] = "1"
        try:
            self.workers.start(topo, me, event)
        finally:
            self.workers.extra_env.pop(names.INPLACE_JOIN, None)
        self._joining = self._forming = topo.round if join else -1
        self._deadline = time.monotonic() + self.cfg.rendezvous.inplace_ready_timeout
        return self.workers.started_how + (", joining in-place survivors" if join else "")

    def finishes_first(self, rdzv: Rendezvous, topo: Topology, now: float) -> bool:
        """Round ``topo`` ended for newcomers while our kept workers still re-form into it (assignments
        written): let them finish (or fail: :meth:`tick`) before the end is acted on, for up to
        :data:`FINISH_FIRST_S`, so that they are kept through the next change too instead of restarted.
        The leader waits for us meanwhile (it forms the next round once we wait for it)."""
        reforming = self._reforming == topo.round and self._published > 0
        if not reforming:
            self._finish_since = None
            return False
        if self._finish_since is None:
            self._finish_since = now
        return finish_first(reforming, now - self._finish_since, lambda: rdzv.ended_for_newcomers(topo.round))

    @property
    def during_inplace(self) -> bool:
        """Our workers are inside an in-place re-form: survivors between their assignment and re-forming
        (after a crash, from the start: they wait in ``InPlace.recover`` instead of training on),
        newcomers until they have received the state."""
        return (self._reforming >= 0 and (self._published > 0 or self._recovering)) or self._forming >= 0

    def mark(self, rows: List[dict]) -> List[dict]:
        """Failure rows of our workers, flagged :data:`~elasticrun.job.inplace.DURING_INPLACE` when they
        failed inside the re-form (the restart that follows is then not charged to ``--max-restarts``),
        else :data:`~elasticrun.job.inplace.RECOVERABLE` when every worker of ours had opted in and no
        re-form is under way: the other nodes may keep theirs (the leader decides, ``plan_inplace``)."""
        opted_in = self.enabled and self._told and not self.busy and not self.carrying
        for row in rows:
            row.update(failure_flags(self.during_inplace, opted_in, row.get("exitcode")))
        self._crashed = bool(rows) and all(row.get(inplace.RECOVERABLE) is True for row in rows)
        return rows

    def leave_first(self, rdzv: Rendezvous, round_: int, sig: int) -> bool:
        """Graceful leave of round ``round_``: signal our workers, mark the leave and revoke our lease
        without waiting for the workers to exit. True once the workers were signalled: the caller must
        not signal them again (a second SIGTERM kills); False: nothing done, the caller leaves as before."""
        if not (self.enabled and round_ >= 0 and sig == signal.SIGTERM) or self.busy or self.carrying:
            return False
        files = self._files()  # opted in, even if the next tick would only now say so in our node record
        if rdzv.lease is None or not files or not all(inplace.opted_in(f) for f in files):
            return False
        for pid in self.workers.pids:
            kill_process_group(pid, sig)  # InPlace.check() turns it into STOP at the next step boundary
        try:
            rdzv.mark_left(round_)  # before the lease goes: the status says Left, not lost
            rdzv.leave()  # the survivors' next round forms now, not once our workers have exited
        except ElasticrunError:
            pass  # etcd unreachable: the caller's own leave (lease still held) tries again
        return True

    def can_keep(self, rdzv: Rendezvous, topo: Topology) -> bool:
        """At the end of round ``topo``: whether our workers may be kept for the next round (no stop):
        they all opted in and still run, no re-form is under way, and the round did not fail, or failed
        only by other nodes' crashes recoverable in place (:func:`keeps_through_failure`)."""
        if not (self.enabled and self._told) or self.busy:
            return False
        if rdzv.round_failed(topo.round) and not self._recoverable(rdzv, topo.round):
            return False
        return self.workers.poll() is GroupState.RUNNING

    def _recoverable(self, rdzv: Rendezvous, round_: int) -> bool:
        try:
            rows = rdzv.root_cause(round_)
        except (ElasticrunError, ValueError, TypeError):
            return False  # cannot tell: the restart path
        return keeps_through_failure(rows, self.cfg.rendezvous.node_id)

    def carry(self, round_: int, failed: bool, broken: bool = False) -> None:
        """Keep our workers through the end of round ``round_`` (:meth:`can_keep` said they may; ``failed``:
        it ended by other nodes' crashes), and tell them: a worker whose collective broke waits for its
        next assignment (``InPlace.recover``) for up to the newcomers' start-up and the re-form's deadline.
        ``broken``: the round's collectives cannot complete (a crash, a lost node): NCCL workers abort theirs."""
        self.carrying = True
        self._recovering = failed
        wait = self.cfg.rendezvous.inplace_ready_timeout + INPLACE_DEADLINE_S
        for path in self._files():
            inplace.announce_recovery(path, round_, wait, broken=failed or broken)

    def _state(self) -> InPlaceState:
        return InPlaceState(told=self._told, joining=self._joining, reforming=self._reforming,
                           published=self._published > 0, deadline=self._deadline)

    def _look(self, rdzv: Rendezvous, topo: Topology, state: InPlaceState, now: float) -> InPlaceSeen:
        """The files and records :func:`inplace_steps` needs in ``state`` (only those: they are read each turn)."""
        files = self._files()
        opted_in = not state.told and not state.busy and bool(files) and all(inplace.opted_in(f) for f in files)
        joined = state.joining >= 0 and bool(files) and all(
            inplace.ready(f) or inplace.formed_round(f) >= state.joining for f in files)
        newcomers_ready = reformed = False
        if state.reforming >= 0 and not state.published:
            have = rdzv.view.under(rdzv.keys.readies(state.reforming))
            newcomers_ready = all(rdzv.keys.ready(state.reforming, n) in have for n in _newcomers(topo))
        elif state.reforming >= 0:
            reformed = all(inplace.formed_round(f) >= state.reforming for f in files)
        return InPlaceSeen(opted_in=opted_in, joined=joined, newcomers_ready=newcomers_ready, reformed=reformed,
                          now=now)

    def tick(self, rdzv: Rendezvous, topo: Topology, call: EtcdCall = direct) -> Optional[str]:
        """One turn of the agent loop while our workers run; why the re-form failed (the caller then takes
        the restart path: :meth:`give_up`), else None. Every etcd write goes through ``call``."""
        if not self.enabled:
            return None
        files = self._files()
        if self._forming >= 0 and files and all(inplace.formed_round(f) >= self._forming for f in files):
            self._forming = -1  # our newcomers received the state: a failure from now on is the round's
        state = self._state()
        seen = self._look(rdzv, topo, state, time.monotonic())
        for step in inplace_steps(state, seen):
            why = self._do(step, rdzv, topo, seen.now, call)
            if why is not None:
                return why
        return None

    def _do(self, step: InPlaceStep, rdzv: Rendezvous, topo: Topology, now: float, call: EtcdCall) -> Optional[str]:
        if step is InPlaceStep.PUBLISH_OPTIN:
            call(lambda: rdzv.publish(inplace=True), "offering in-place re-forming")
            self._told = True
        elif step is InPlaceStep.MARK_JOINED:
            key = rdzv.keys.ready(self._joining, rdzv.node_id)
            call(lambda: rdzv.store.put_json(key, {"time": time.time()}), "telling the survivors we are ready")
            self._joining = -1
        elif step is InPlaceStep.STOP_JOINING:
            self._joining = -1  # the survivors give up on us: their round fails
        elif step is InPlaceStep.PUBLISH_ASSIGNMENTS:
            for w, env in zip(self.workers.running, self._envs):
                inplace.write_assignment(self.workers.inplace_file(w.spec.local_rank), env)
            self._published = now
            self._deadline = now + INPLACE_DEADLINE_S
        elif step is InPlaceStep.REFORMED:
            self.say(f"round {self._reforming}: workers re-formed in place in {now - self._published:.2f} s")
            self._reforming, self._recovering = -1, False
        elif step is InPlaceStep.NEWCOMERS_LATE:
            wait = self.cfg.rendezvous.inplace_ready_timeout
            return f"newcomers {', '.join(_newcomers(topo))} not ready within {wait:g} s"
        elif step is InPlaceStep.REFORM_LATE:
            return f"workers did not re-form within {INPLACE_DEADLINE_S:g} s"
        return None

    def give_up(self, rdzv: Rendezvous, topo: Topology, why: str, call: EtcdCall = direct) -> None:
        """The re-form failed (``why``): report our workers failed and kill them (a half-made group: no
        graceful stop); the next round restarts them. With ``--hang-timeout`` (the workers answer the stack
        signal) each worker's Python stacks reach the log first: where it stood instead of re-forming."""
        stacks = self.cfg.health.hang_timeout > 0 and bool(self.workers.running)
        self.say(f"round {topo.round}: in-place re-form failed ({why}): "
                 + ("dumping every worker's Python stacks, then restarting the round" if stacks
                    else "restarting the round"))
        if stacks:
            rdzv.beat(busy_for=STACKS_WAIT_S)
            dump_stacks(self.workers.running)
        rows = [make_failure(w.spec.member.node_id, w.spec.member.host, w.spec.rank, w.spec.local_rank,
                             inplace.EXIT_INPLACE_FAILED, w.spec.error_file).to_dict() for w in self.workers.running]
        self._reforming, self._recovering = -1, False
        call(lambda: rdzv.report_failure(topo, rows), "reporting a failed re-form")
        stop_workers(rdzv, self.workers, 1.0, sig=signal.SIGKILL)


def finish_first(reforming: bool, waited_s: float, for_newcomers: Callable[[], bool]) -> bool:
    """Whether a round's end waits for our kept workers to finish re-forming into that round: they are
    (``reforming``: assignments written), the end is for newcomers only (``for_newcomers``, read last:
    no member's collective broke) and it has waited less than :data:`FINISH_FIRST_S`."""
    return reforming and waited_s < FINISH_FIRST_S and for_newcomers()


def failure_flags(during_inplace: bool, opted_in: bool, exitcode: Any) -> Dict[str, bool]:
    """The in-place flags of a failure row of ours: :data:`~elasticrun.job.inplace.DURING_INPLACE` inside
    a re-form (its restart is free); else, when every worker of ours had opted in and no re-form is
    under way (``opted_in``), :data:`~elasticrun.job.inplace.RECOVERABLE` (false for a worker that
    itself could not re-form, exit 75); else none."""
    if during_inplace:
        return {inplace.DURING_INPLACE: True}
    if opted_in:
        return {inplace.RECOVERABLE: exitcode != inplace.EXIT_INPLACE_FAILED}
    return {}


def _newcomers(topo: Topology) -> List[str]:
    """The members of ``topo`` that start new workers (not re-formed in place)."""
    return [m.node_id for m in topo.members if m.node_id not in topo.inplace]


class InPlaceStep(str, enum.Enum):
    """One thing :meth:`InPlaceRounds.tick` does (:func:`inplace_steps` says which)."""

    PUBLISH_OPTIN = "publish-optin"  # every local worker opted in: our node record says inplace=True
    MARK_JOINED = "mark-joined"  # our newcomer workers are about to join: write ready/<node>
    STOP_JOINING = "stop-joining"  # past --inplace-ready-timeout: the survivors gave up on us
    PUBLISH_ASSIGNMENTS = "publish-assignments"  # every newcomer is ready: write our kept workers' assignments
    REFORMED = "reformed"  # every kept worker formed the new round
    NEWCOMERS_LATE = "newcomers-late"  # a newcomer not ready within --inplace-ready-timeout: the re-form failed
    REFORM_LATE = "reform-late"  # a kept worker not re-formed INPLACE_DEADLINE_S after its assignment: failed


@dataclass(frozen=True)
class InPlaceState:
    """Where :class:`InPlaceRounds` stands (a copy: :func:`inplace_steps` changes nothing)."""

    told: bool  # our node record says inplace=True
    joining: int  # the round our newcomer workers join (-1: none)
    reforming: int  # the round our kept workers re-form for (-1: none)
    published: bool  # their assignments are written
    deadline: float  # when the pending join or re-form step gives up (monotonic seconds)

    @property
    def busy(self) -> bool:
        return self.reforming >= 0 or self.joining >= 0


@dataclass(frozen=True)
class InPlaceSeen:
    """What a tick read (each only where ``InPlaceState`` needs it, else False)."""

    opted_in: bool  # every running local worker opted in (and one runs)
    joined: bool  # our newcomer workers are ready for (or formed) the round they join
    newcomers_ready: bool  # every newcomer of the round we re-form for wrote its ready key
    reformed: bool  # every kept worker formed the round we re-form for
    now: float


def inplace_steps(state: InPlaceState, seen: InPlaceSeen) -> List[InPlaceStep]:
    """What one tick does, in order; at most one of :attr:`InPlaceStep.NEWCOMERS_LATE` and
    :attr:`InPlaceStep.REFORM_LATE`, last (the re-form failed)."""
    steps: List[InPlaceStep] = []
    if not state.told and not state.busy and seen.opted_in:
        steps.append(InPlaceStep.PUBLISH_OPTIN)
    if state.joining >= 0:
        if seen.joined:
            steps.append(InPlaceStep.MARK_JOINED)
        elif seen.now > state.deadline:
            steps.append(InPlaceStep.STOP_JOINING)
    if state.reforming < 0:
        return steps
    if not state.published:
        if seen.newcomers_ready:
            steps.append(InPlaceStep.PUBLISH_ASSIGNMENTS)
        elif seen.now > state.deadline:
            steps.append(InPlaceStep.NEWCOMERS_LATE)
    elif seen.reformed:
        steps.append(InPlaceStep.REFORMED)
    elif seen.now > state.deadline:
        steps.append(InPlaceStep.REFORM_LATE)
    return steps


__all__ = ["EtcdCall", "FINISH_FIRST_S", "InPlaceRounds", "direct", "failure_flags", "finish_first", "InPlaceSeen",
           "InPlaceState", "InPlaceStep", "inplace_steps"]
