"""What a running round does when its lease is in doubt: ride out an etcd outage, or fence.

The rule (docs/design.md, "etcd outages and liveness"):

- lease HELD: nothing to do (an outage that ends before the lease needed etcd is invisible);
- lease IN_DOUBT (etcd does not answer; we keep trying): workers keep training. Nobody can
  write a new round while etcd is unreachable, and a node cut off alone cannot hurt the new
  round the others may form: its stale workers have no peers left and cannot commit a
  checkpoint (the commit fence needs etcd). If the outage outlasts ``--etcd-outage-grace``
  the workers get SIGTERM and ``--shutdown-timeout`` to save (never SIGKILL first), and
  the agent gives up (exit 138, ExitCode.TRANSIENT);
- lease LOST after an outage (etcd answered: the lease expired meanwhile): if the job is
  still at our round with no failure or end flag, re-register and keep the workers (the
  round's topology is updated to our new lease); otherwise a newer round exists: fence;
- lease LOST without an outage (this process was frozen, or etcd revoked it): fence at once
  (SIGKILL) and rejoin, as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from typing import Callable, Optional, TypeVar

from elasticrun.errors import StoreError, StoreFullError
from elasticrun.job import records
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.workers import WorkerGroup
from elasticrun.rendezvous.protocol import LeaseLost, Rendezvous
from elasticrun.rendezvous.records import Topology, topology_record
from elasticrun.rendezvous.states import RoundOutcome
from elasticrun.store.lease import LeaseHealth

T = TypeVar("T")
log = logging.getLogger(__name__)

STOP_SLACK_S = 30.0  # beyond the shutdown grace: reaping, joining log pumps (each bounded)


def stop_workers(rdzv: Rendezvous, workers: WorkerGroup, grace: float, sig: int = signal.SIGTERM) -> None:
    """Stop the workers, telling the lease's liveness gate that this wait is bounded."""
    rdzv.beat(busy_for=grace + STOP_SLACK_S)
    workers.stop(grace, sig=sig)
    rdzv.beat()


def rejoin_round(rdzv: Rendezvous, topo: Topology) -> bool:
    """After an outage that outlived our lease: rejoin round ``topo`` if nothing happened meanwhile.

    True when the job is still at round ``topo`` (no newer round, no failure or end flag, job
    not over): we then hold a new lease, our node record is back, and the round's topology
    names our new lease (a compare-and-swap, so a concurrent new round wins and we return
    False). False: the round is over for us; the caller fences. Raises StoreError if etcd
    stops answering again.
    """
    old, rdzv.lease = rdzv.lease, None
    if old is not None:
        old.stop()
    rdzv.register(wait_for_old=True)
    rdzv.outage_over_at = time.monotonic()
    store, keys = rdzv.store, rdzv.keys
    while True:
        if records.read(store.get(keys.state), records.state_record) is not None:
            return False
        kv = store.get(keys.topology)
        current = records.read(kv, topology_record)  # a malformed round cannot be confirmed: fence
        if kv is None or current is None or current.round != topo.round:
            return False
        if (records.read(store.get(keys.failed(topo.round)), records.failed_flag) is not None
                or records.read(store.get(keys.end(topo.round)), records.end_flag) is not None):
            return False
        assert rdzv.lease is not None
        lease_id = rdzv.lease.lease_id
        members = tuple(
            dataclasses.replace(m, lease=lease_id) if m.node_id == rdzv.node_id else m for m in current.members
        )
        if store.cas(keys.topology, json.dumps(dataclasses.replace(current, members=members).to_dict()),
                     kv.mod_revision):
            log.info("rejoined round %d after an etcd outage with lease %x", topo.round, lease_id)
            return True


class OutageGuard:
    """Decides, each turn of the round loop, whether our workers may keep running."""

    def __init__(self, cfg: LaunchConfig, rdzv: Rendezvous, workers: WorkerGroup, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.workers = workers
        self.say = say
        self.since: Optional[float] = None  # when etcd stopped answering (None: no outage now)
        self.full: Optional[str] = None  # etcd answers but is out of space (NOSPACE): its one-line error

    def _outage_age(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def _enter(self) -> None:
        if self.since is None:
            lease = self.rdzv.lease
            self.since = time.monotonic() - (lease.unconfirmed_for() if lease is not None else 0.0)
            self.say(
                f"etcd does not answer (lease unconfirmed for {self._outage_age():.0f}s): workers keep "
                f"training for up to --etcd-outage-grace {self.cfg.etcd.etcd_outage_grace:.0f}s"
            )

    def _give_up(self, what: str) -> None:
        if self.full is not None:
            self.say(f"etcd refused writes for {self._outage_age():.0f}s (more than --etcd-outage-grace "
                     f"{self.cfg.etcd.etcd_outage_grace:.0f}s): stopping workers (SIGTERM, "
                     f"{self.cfg.workers.shutdown_timeout:.0f}s to save)")
            stop_workers(self.rdzv, self.workers, self.cfg.workers.shutdown_timeout)
            raise StoreFullError(f"{self.full} (while {what}; workers were stopped)")
        self.say(
            f"etcd unreachable for {self._outage_age():.0f}s (more than --etcd-outage-grace "
            f"{self.cfg.etcd.etcd_outage_grace:.0f}s): stopping workers (SIGTERM, "
            f"{self.cfg.workers.shutdown_timeout:.0f}s to save)"
        )
        stop_workers(self.rdzv, self.workers, self.cfg.workers.shutdown_timeout)
        raise StoreError(f"etcd unreachable for {self._outage_age():.0f}s while {what}; workers were stopped")

    def check(self, topo: Topology) -> Optional[RoundOutcome]:
        """None: keep running round ``topo``. 'next': our workers were stopped; form the next round."""
        health = self.rdzv.lease_health()
        if health is LeaseHealth.HELD:
            if self.since is not None:
                self.say(f"etcd answers again after {self._outage_age():.0f}s; our lease held: workers kept running")
                self.rdzv.outage_over_at = time.monotonic()
                self.since = None
            return None
        if health is LeaseHealth.IN_DOUBT:
            self._enter()
            if self._outage_age() > self.cfg.etcd.etcd_outage_grace:
                self._give_up("running a round")
            return None
        lease = self.rdzv.lease
        reason = lease.lost_reason if lease is not None else "no lease"
        if self.since is None and not self.rdzv.recently_unreachable():
            # No outage: this process was frozen past its lease (or etcd revoked it). Fence first.
            stop_workers(self.rdzv, self.workers, 0.0, sig=signal.SIGKILL)
            self.say(f"lost our etcd lease ({reason}): stopped our workers (fencing); rejoining")
            self.rdzv.reregister()
            return RoundOutcome.NEXT
        try:
            resumed = rejoin_round(self.rdzv, topo)
        except StoreError:
            if self.since is None:
                self._enter()
            if self._outage_age() > self.cfg.etcd.etcd_outage_grace:
                self._give_up("rejoining after an outage")
            return None  # etcd flaps: try again next turn (the lease is re-taken then)
        age = self._outage_age()
        self.since = None
        if resumed:
            self.say(
                f"etcd answers again after {age:.0f}s; our lease had expired but round {topo.round} is unchanged: "
                "re-registered, workers kept running"
            )
            return None
        self.say(f"etcd answers again after {age:.0f}s: round {topo.round} is over for us: stopping workers (fencing)")
        stop_workers(self.rdzv, self.workers, 0.0, sig=signal.SIGKILL)
        return RoundOutcome.NEXT

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run an etcd operation, retrying through an outage up to ``--etcd-outage-grace``.

        Raises LeaseLost (after stopping our workers) when etcd answers but our lease is gone.
        """
        while True:
            self.rdzv.beat(busy_for=self.cfg.etcd.etcd_timeout + self.rdzv.store.timeout)
            try:
                result = fn()
            except StoreError as err:
                lease = self.rdzv.lease
                if lease is not None and lease.health() is LeaseHealth.LOST:
                    # etcd answers, but our lease expired meanwhile (an outage, a partition, a
                    # freeze): retrying with it can never succeed. Fence and rejoin instead.
                    stop_workers(self.rdzv, self.workers, 0.0, sig=signal.SIGKILL)
                    self.since = None
                    raise LeaseLost(lease.lost_reason or "lease expired") from None
                if isinstance(err, StoreFullError) and self.full is None:
                    self.full = str(err)  # etcd answers: say why it refuses, not "does not answer"
                    self.since = self.since or time.monotonic()
                    self.say(f"{err}; retrying for up to --etcd-outage-grace {self.cfg.etcd.etcd_outage_grace:.0f}s")
                if self.since is None:
                    self.since = time.monotonic() - self.cfg.etcd.etcd_timeout
                    self.say(f"etcd does not answer while {what}; retrying for up to --etcd-outage-grace")
                if self._outage_age() > self.cfg.etcd.etcd_outage_grace:
                    self._give_up(what)
                time.sleep(0.5)
                continue
            self.rdzv.beat()
            if self.full is not None:
                self.say("etcd accepts writes again")
                self.full, self.since = None, None
            return result
