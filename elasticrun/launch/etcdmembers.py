"""The agent's side of a job's own etcd: grow it to three members, replace lost ones, tell every client.

A job started with torchrun's c10d or static line hosts its etcd in one agent (launch/hosting.py).
Every agent of such a job runs an :class:`EtcdMembers` thread, with its own etcd client, from the
moment its node joined until it leaves:

- **the agent that leads the rendezvous** (it holds the ``leader`` key; one at a time) reads etcd's
  member list and the ``etcd/`` records, asks :func:`~elasticrun.rendezvous.etcdplan.plan` for one
  change and makes it: remove a member whose node is gone, ask a node to start a member
  (``etcd/assign/<node>``, written only while the leader key is still the one it read), drop a stale
  request or record. It publishes the voting members' client endpoints (``etcd/endpoints``);
- **an agent asked to start a member** picks two free ports on its own address, records the member
  (``etcd/members/<node>``), adds it to etcd as a learner, starts it with the cluster's state
  (``--initial-cluster-state existing``), promotes it once it caught up, and removes the request;
  when it cannot, it says why in the request (the leader asks another node);
- **every agent** points its own client, the agent's client and its workers' settings file (rewritten
  atomically: a worker that connects reads it) at the published endpoints, and watches the member it
  runs: one that exits (removed by the leader, crashed) is cleaned up and recorded no more.

When the agent leaves (:meth:`EtcdMembers.close`), a member it runs is removed from etcd first, unless
it is the last voting member: that one serves until the other nodes left (at most ``close_timeout``,
as the hosting agent always did), or stops at once when the agent was signalled. The thread that
starts a member's process is the one that stops it (the parent-death signal follows the thread).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from elasticrun.errors import ElasticrunError, StoreError, StoreSetupError
from elasticrun.job import records
from elasticrun.job.settings import to_file
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.etcdhome import member_server, sweep
from elasticrun.rendezvous import etcdplan
from elasticrun.rendezvous.etcdplan import (
    Action,
    Assign,
    Assignment,
    DropAssignment,
    DropRecord,
    Endpoints,
    MemberRecord,
    Remove,
    Snapshot,
    Wait,
    assignment_record,
    endpoints_record,
    member_record,
)
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.store import members as etcd
from elasticrun.store.client import EtcdStore, KeyValue
from elasticrun.store.server import EtcdServer
from elasticrun.store.types import Guard, Member, dumps

log = logging.getLogger(__name__)

TURN_S = 1.0  # between two looks when nothing wakes the thread
LEAD_EVERY_S = 0.5  # the leader reads etcd's member list at most this often (at once after a change)
CALL_RETRY_S = 5.0  # this thread's etcd calls give up after this long (the next turn tries again)
PROMOTE_PAUSE_S = 0.05
PROBE_S = 1.0  # a member of a missing node that does not answer within this is taken for dead
HANDOVER_S = 15.0  # a signalled agent with the last member serves this long for another node to take it over


class MemberFailed(StoreError):
    """Our new member cannot serve (it exited, did not catch up, or the request was withdrawn): the node
    refuses the request. Any other StoreError while starting one is etcd not answering for a moment."""


class EtcdMembers:
    """The thread of one agent (see the module doc): :meth:`start` once the node joined, :meth:`close` at exit."""

    def __init__(self, cfg: LaunchConfig, rdzv: Rendezvous, hosted: Optional[EtcdServer], settings_file: Optional[str],
                 say: Callable[[str], None], settings: Optional[etcdplan.Settings] = None) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.keys = rdzv.keys
        self.say = say
        self.settings = settings or etcdplan.Settings(most=cfg.rendezvous.etcd_members)
        self.settings_file = settings_file
        self.store: Optional[EtcdStore] = None  # our own client (made by the thread)
        self.member: Optional[EtcdServer] = hosted  # the member this node runs (hosted: started by the agent)
        self._spawned = False  # we started self.member's process (we stop it)
        self._endpoints = cfg.rendezvous.rdzv_endpoint  # what every client of ours talks to
        self._stop = threading.Event()
        self._signalled = False
        self._etcd_failed = False
        self._thread = threading.Thread(target=self._run, name="etcd-members", daemon=True)
        self._first_seen: Dict[int, float] = {}
        self._refused: Dict[str, float] = {}
        self._led_at = 0.0
        self._said = ""
        self._served = 0  # the mod revision of the last request we served (our view may show it a moment longer)
        self._told_rev = 0  # the mod revision of the endpoints we use (etcd/endpoints)
        self._missing: Dict[int, float] = {}  # member id → since when the leader misses its node

    # -- the agent's calls ---------------------------------------------------------------------------

    def start(self) -> EtcdMembers:
        self._thread.start()
        return self

    def close(self, signalled: bool, etcd_failed: bool) -> None:
        """Leave: remove our member from etcd (see the module doc), stop it, end the thread."""
        self._signalled, self._etcd_failed = signalled, etcd_failed
        self._stop.set()
        self.rdzv.view.poke()
        self._thread.join(self.cfg.rendezvous.rdzv_close_timeout + 2 * CALL_RETRY_S + 10.0)

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.store = self.cfg.etcd_settings().connect(None, check=False, retry_timeout=CALL_RETRY_S)
            if self.member is not None:
                self._record_hosted()
            version = 0
            while not self._stop.is_set():
                try:
                    self._turn()
                except ElasticrunError as err:  # etcd busy or gone for a moment: the next turn tries again
                    self._tell(f"the job's etcd members: {err}", debug=True)
                except Exception as err:  # noqa: BLE001 - this thread is the parent of our member: it must live
                    log.exception("etcd members: %s", err)
                version = self.rdzv.view.wait_change(version, TURN_S)
                self._stop.wait(0.05)  # at most 20 turns a second, whatever wakes us
            self._leave()
        finally:
            if self.store is not None:
                self.store.close()

    def _turn(self) -> None:
        self._follow_endpoints()
        self._check_member()
        self._serve_assignment()
        if self._leads() and time.monotonic() - self._led_at >= LEAD_EVERY_S:
            self._led_at = time.monotonic()
            if self._lead():
                self._led_at = 0.0  # changed something: look again at once

    def _tell(self, line: str, debug: bool = False) -> None:
        """Say ``line`` once (until another line was said)."""
        if line != self._said:
            self._said = line
            (log.debug if debug else self.say)(line)

    def _leads(self) -> bool:
        kv = self.rdzv.view.get(self.keys.leader)
        lease = self.rdzv.lease
        return kv is not None and lease is not None and kv.lease == lease.lease_id and self.rdzv.view.mirrors_nodes

    # -- every agent: endpoints, our member --------------------------------------------------------

    def _follow_endpoints(self) -> None:
        kv = self.rdzv.view.get(self.keys.etcd_endpoints)
        told = records.read(kv, endpoints_record)
        if kv is not None and told is not None:
            self._use(told, kv.mod_revision)

    def _use(self, told: Endpoints, revision: int) -> None:
        """Point our client, the agent's and the workers' settings file at ``told``'s endpoints (written at
        ``revision``) — unless we use newer ones (the leader's own, written before its view shows them)."""
        joined = ",".join(told.endpoints)
        if joined == self._endpoints or revision <= self._told_rev:
            return
        self._endpoints, self._told_rev = joined, revision
        endpoints = told.endpoints
        assert self.store is not None
        self.store.set_endpoints(joined)
        self.rdzv.store.set_endpoints(joined)
        if self.settings_file:
            to_file(self.cfg.etcd_settings().replace(endpoints=joined), self.settings_file)
        self.say(f"the job's etcd is at {joined} ({len(endpoints)} member{'s' * (len(endpoints) > 1)}; "
                 f"`elasticrun status --rdzv-endpoint` takes any of them)")

    def _check_member(self) -> None:
        """Our member exited (removed by the leader, or crashed): clean up, record it no more."""
        if self.member is None or self.member.running():
            return
        assert self.store is not None
        listed = any(self.member.peer_url in m.peer_urls for m in etcd.list_members(self.store))
        why = f"it exited ({self.member.exit_reason() or 'no reason in its log'})" if listed else "it was removed"
        self.say(f"our member of the job's etcd stopped: {why}")
        self._drop_own(remove=listed)

    def _drop_own(self, remove: bool) -> None:
        """Forget our member: remove it from etcd (``remove``, when still listed), its record, its process."""
        member, self.member = self.member, None
        if member is None:
            return
        assert self.store is not None
        try:
            if remove:
                mine = [m for m in etcd.list_members(self.store) if member.peer_url in m.peer_urls]
                if mine:
                    etcd.remove(self.store, mine[0].member_id)
            self.store.delete(self.keys.etcd_member(self.rdzv.node_id))
        except StoreError as err:
            log.debug("dropping our etcd member: %s", err)
        if self._spawned:
            member.stop()
            self._spawned = False

    def _record_hosted(self) -> None:
        """The hosting agent: record the member it started (before anyone may plan without it)."""
        assert self.member is not None and self.store is not None
        if self.member.host == "0.0.0.0":  # no record: no node plans a member beside one it cannot reach
            self.say("the job's etcd listens on every interface of this node: it stays a single member "
                     "(its other nodes cannot be told an address to reach it by)")
            return
        mine = [m for m in etcd.list_members(self.store) if self.member.peer_url in m.peer_urls]
        self._put_record(self.member, mine[0].member_id if mine else 0)

    def _put_record(self, member: EtcdServer, member_id: int, guard: Optional[Guard] = None,
                    leaving: bool = False) -> bool:
        node = self.rdzv.node
        rec = MemberRecord(node_id=node.node_id, name=member.name, peer_url=member.peer_url,
                           client_url=member.client_url, pid=node.pid, host=node.host, member_id=member_id,
                           time=time.time(), leaving=leaving)
        assert self.store is not None
        return self.store.txn([guard] if guard else [], puts=[(self.keys.etcd_member(node.node_id),
                                                              dumps(rec.to_dict()), None)])

    # -- an agent asked to start a member ------------------------------------------------------------

    def _serve_assignment(self) -> None:
        kv = self.rdzv.view.get(self.keys.etcd_assignment(self.rdzv.node_id))
        request = records.read(kv, assignment_record)
        if kv is None or request is None or request.failed or kv.mod_revision <= self._served:
            return
        self._served = kv.mod_revision
        if self.member is not None:
            self._refuse(kv, request, "it runs a member already")
            return
        try:
            self._start_member(kv)
        except (MemberFailed, etcd.MembershipRefused, StoreSetupError) as err:
            self._drop_own(remove=True)
            self._refuse(kv, request, str(err))
        except StoreError as err:  # etcd busy or changing members: try again next turn (the leader drops it when late)
            self._drop_own(remove=True)
            self._served = 0
            self._tell(f"could not start a member of the job's etcd yet ({err}); trying again")

    def _refuse(self, kv: KeyValue, request: Assignment, why: str) -> None:
        self.say(f"cannot start a member of the job's etcd: {why}")
        failed = Assignment(request.node_id, request.by, request.time, failed=why[:300])
        assert self.store is not None
        try:
            self.store.txn([Guard(kv.key, kv.mod_revision)], puts=[(kv.key, dumps(failed.to_dict()), None)])
        except StoreError as err:
            log.debug("could not refuse an etcd assignment: %s", err)

    def _start_member(self, request: KeyValue) -> None:
        """Record, add as a learner, start, promote (see the module doc); ElasticrunError when it cannot."""
        assert self.store is not None
        node = self.rdzv.node
        name = f"{node.node_id}-{secrets.token_hex(3)}"
        server = member_server(self.cfg.rendezvous.rdzv_id, node.node_id, self.cfg.etcd.etcd_binary, name=name,
                               host=node.addr, joins=True)
        self.member, self._spawned = server, True
        guard = Guard(request.key, request.mod_revision)
        if not self._put_record(server, 0, guard):
            raise MemberFailed("the request was withdrawn")
        new, listed = etcd.add_learner(self.store, server.peer_url)
        self._put_record(server, new.member_id, guard)
        server.initial_cluster = etcd.initial_cluster(listed, new.member_id, name)
        try:
            server.start(wait_healthy=False)
        except StoreError as err:
            raise MemberFailed(str(err)) from None
        self._promote(server, new.member_id, request)
        try:
            server.wait_healthy(self.settings.assign_timeout)
        except StoreError as err:
            raise MemberFailed(str(err)) from None
        self.store.txn([guard], deletes=[request.key])
        self.say(f"started a member of the job's etcd at {server.endpoint}")

    def _promote(self, server: EtcdServer, member_id: int, request: KeyValue) -> None:
        """Promote the learner once etcd says it caught up; StoreError past the assignment's deadline."""
        assert self.store is not None
        deadline = time.monotonic() + self.settings.assign_timeout
        while True:
            if not server.running():
                raise MemberFailed(f"our etcd member exited at start: {server.exit_reason()[:300]}")
            if self._stop.is_set() or self.rdzv.view.get(request.key) is None:
                raise MemberFailed("the request was withdrawn")
            try:
                etcd.promote(self.store, member_id)
                return
            except etcd.LearnerNotReady:
                if time.monotonic() > deadline:
                    raise MemberFailed(f"our learner did not catch up in {self.settings.assign_timeout:.0f} s") \
                        from None
            time.sleep(PROMOTE_PAUSE_S)

    # -- the leader ----------------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        assert self.store is not None
        listed = etcd.list_members(self.store)
        now = time.time()
        for m in listed:
            self._first_seen.setdefault(m.member_id, now)
        kvs, _ = self.store.get_prefix(self.keys.etcd)
        recs = {kv.key[len(self.keys.etcd_members):]: records.read(kv, member_record)
                for kv in kvs if kv.key.startswith(self.keys.etcd_members)}
        asks = {kv.key[len(self.keys.etcd_assignments):]: records.read(kv, assignment_record)
                for kv in kvs if kv.key.startswith(self.keys.etcd_assignments)}
        return Snapshot(
            members=tuple(listed), records={k: v for k, v in recs.items() if v is not None},
            assignments={k: v for k, v in asks.items() if v is not None},
            nodes={node_id: info for node_id, (info, _) in self.rdzv.view.nodes().items()},
            leader_id=etcd.leader_id(self.store), ended=self.rdzv.view.state() is not None,
            first_seen=dict(self._first_seen), refused=dict(self._refused),
            published=next((records.read(kv, endpoints_record) for kv in kvs if kv.key == self.keys.etcd_endpoints),
                           None),
            missing=self._probe_missing(listed, recs, now),
        )

    def _probe_missing(self, listed: List[Member], recs: Dict[str, Optional[MemberRecord]],
                       now: float) -> Dict[int, Tuple[float, bool]]:
        """For each member whose node is not registered: since when we miss it, and whether it answers."""
        live = self.rdzv.view.nodes()
        gone = {r.peer_url: r for r in recs.values() if r is not None and r.node_id not in live}
        missing: Dict[int, Tuple[float, bool]] = {}
        for m in listed:
            if not any(url in gone for url in m.peer_urls):
                continue
            since = self._missing.setdefault(m.member_id, now)
            missing[m.member_id] = (since, bool(m.client_urls) and etcd.answers(m.client_urls[0], PROBE_S))
        self._missing = {k: v for k, v in self._missing.items() if k in missing}
        return missing

    def _lead(self) -> bool:
        """One look: publish the endpoints, make the plan's change; True when something changed."""
        snap = self._snapshot()
        leader_kv = self.rdzv.view.get(self.keys.leader)
        if leader_kv is None:
            return False
        guard = Guard(leader_kv.key, leader_kv.mod_revision)  # only while we still lead
        published = self._publish(snap, guard)
        action = etcdplan.plan(snap, self.settings, time.time())
        return self._act(action, guard) or published

    def _publish(self, snap: Snapshot, guard: Guard) -> bool:
        """Tell every client the voting members' endpoints when they changed (ours at once: our own view may
        be on a member about to go)."""
        endpoints = tuple(etcdplan.client_endpoints(snap))
        if not endpoints or (snap.published is not None and endpoints == snap.published.endpoints):
            return False
        assert self.store is not None
        told = Endpoints(endpoints, time.time())
        if not self.store.txn([guard], puts=[(self.keys.etcd_endpoints, dumps(told.to_dict()), None)]):
            return False
        kv = self.store.get(self.keys.etcd_endpoints)  # its revision: our view may show an older one a moment longer
        now_told = records.read(kv, endpoints_record)
        if kv is not None and now_told is not None:
            self._use(now_told, kv.mod_revision)
        return True

    def _act(self, action: Action, guard: Guard) -> bool:
        assert self.store is not None
        if isinstance(action, Wait):
            self._tell(f"the job's etcd: {action.reason}", debug=True)
            return False
        if isinstance(action, Remove):
            try:
                etcd.remove(self.store, action.member_id)
            except etcd.MembershipRefused as err:
                if not etcd.already_gone(err):  # a retried call whose first try removed it
                    self._tell(f"cannot remove member {action.name} from the job's etcd ({action.reason}): {err}")
                    return False
            self.say(f"removed member {action.name} from the job's etcd: {action.reason}")
            return True
        if isinstance(action, Assign):
            request = Assignment(action.node_id, self.rdzv.node_id, time.time())
            key = self.keys.etcd_assignment(action.node_id)
            if self.store.txn([guard, Guard.absent(key)], puts=[(key, dumps(request.to_dict()), None)]):
                self.say(f"asking node {action.node_id} to start a member of the job's etcd ({action.reason})")
                return True
            return False
        if isinstance(action, DropAssignment):
            if action.failed:
                self._refused[action.node_id] = time.time()
            self._tell(f"the job's etcd: {action.reason}")
            return self.store.txn([guard], deletes=[self.keys.etcd_assignment(action.node_id)])
        assert isinstance(action, DropRecord)
        log.info("the job's etcd: %s", action.reason)
        return self.store.txn([guard], deletes=[self.keys.etcd_member(action.node_id)])

    # -- leaving --------------------------------------------------------------------------------------

    def _leave(self) -> None:
        """Remove our member unless it is the last voter; that one serves on until the other nodes left or
        one of them took it over (see :meth:`_serve_last`). Then stop what we started, and sweep what killed
        agents left on this machine."""
        if self.member is None:
            return
        if not self._etcd_failed and not self._remove_own():
            close = self.cfg.rendezvous.rdzv_close_timeout
            wait = close if not self._signalled else min(HANDOVER_S, close)
            self._serve_last(wait)
        if self._spawned:
            assert self.member is not None
            self.member.stop()
        self.member = None
        sweep()

    def _serve_last(self, timeout: float) -> None:
        """The last voting member, our node gone from the job: keep serving until no other node is
        registered, or the leader moved the job's etcd to another node (added a member there and removed
        ours: a job of one or two nodes survives a graceful leave of the node holding it), at most
        ``timeout`` s."""
        assert self.member is not None and self.store is not None
        deadline = time.monotonic() + timeout
        told = False
        try:  # the leader moves it at once (not after the grace a node that may come back is given)
            mine = [m for m in etcd.list_members(self.store) if self.member.peer_url in m.peer_urls]
            self._put_record(self.member, mine[0].member_id if mine else 0, leaving=True)
        except StoreError as err:
            log.debug("could not mark our etcd member as leaving: %s", err)
        while time.monotonic() < deadline and self.member.running():
            try:
                others = len(self.store.get_prefix(self.keys.nodes)[0])
                ours = any(self.member.peer_url in m.peer_urls for m in etcd.list_members(self.store))
            except StoreError:
                return
            if not others or not ours:
                return
            if not told:
                self.say(f"waiting up to {timeout:.0f}s for {others} other node(s) to leave or to take over the "
                         "job's etcd before stopping its member here")
                told = True
            time.sleep(0.2)

    def _remove_own(self) -> bool:
        """Remove our member from etcd when another voter keeps the cluster; True when it did."""
        assert self.member is not None and self.store is not None
        try:
            listed = etcd.list_members(self.store)
            mine = [m for m in listed if self.member.peer_url in m.peer_urls]
            others = [m for m in listed if m.voter and m.started and m not in mine]
            if not mine or not others:
                return False
            etcd.remove(self.store, mine[0].member_id)
        except StoreError as err:  # MembershipRefused: the others are not enough for a quorum without us
            log.debug("could not remove our etcd member: %s", err)
            return False
        self.say("removed our member from the job's etcd")
        try:
            self.store.delete(self.keys.etcd_member(self.rdzv.node_id))
        except StoreError as err:
            log.debug("could not remove our etcd member's record: %s", err)
        return True


def start_members(cfg: LaunchConfig, rdzv: Rendezvous, hosted: Optional[EtcdServer], settings_file: Optional[str],
                  say: Callable[[str], None]) -> Optional[EtcdMembers]:
    """The :class:`EtcdMembers` thread of an agent whose job hosts its etcd (c10d, static); None otherwise."""
    if not cfg.hosts_etcd():
        return None
    return EtcdMembers(cfg, rdzv, hosted, settings_file, say).start()


__all__: List[str] = ["EtcdMembers", "start_members"]
