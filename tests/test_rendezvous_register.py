"""Registration against a real etcd when the lease is gone before the node record is written
(more than the heartbeat between granting the lease and the write: a slow etcd or machine)."""

from __future__ import annotations

from typing import List, Optional, Set

import pytest

import elasticrun.rendezvous.register as register
from elasticrun.errors import RendezvousError
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.store.client import EtcdStore

from helpers.rdzv import settings

pytestmark = pytest.mark.integration  # starts etcd or processes


class LeaseDroppedBeforeCreate(EtcdStore):
    """A real client whose creates number ``revoke_at`` (counting creates under a lease: the node record's
    guarded transaction and the --node-rank claim) find their lease revoked by a second client just before
    they are sent, as if etcd had expired it meanwhile."""

    def __init__(self, endpoint: str, other: EtcdStore, revoke_at: Optional[Set[int]] = None) -> None:
        super().__init__(endpoint)
        self.other = other
        self.revoke_at = revoke_at
        self.creates = 0
        self.revoked: List[int] = []

    def _before(self, lease: Optional[int]) -> None:
        if lease:
            if self.revoke_at is None or self.creates in self.revoke_at:
                self.other.revoke_lease(lease)
                self.revoked.append(lease)
            self.creates += 1

    def create(self, key, value, lease=None) -> bool:
        self._before(lease)
        return super().create(key, value, lease=lease)

    def txn(self, guards, puts=(), delete_prefixes=(), deletes=()) -> bool:
        puts = list(puts)
        self._before(next((lease for _, _, lease in puts if lease), None))
        return super().txn(guards, puts, delete_prefixes, deletes)


def rendezvous(store: EtcdStore, job_id: str) -> Rendezvous:
    info = NodeInfo(node_id="a", host="h", addr="127.0.0.1", nproc=1, pid=1, node_rank=0)
    return Rendezvous(store, settings(job_id=job_id, heartbeat_timeout=3.0), info, lambda: 29500)


def test_a_lease_gone_before_the_record_is_replaced_and_the_records_are_under_the_new_one(etcd, job_id):
    # Create 0: the node record's (lease 1 revoked). Create 2: the --node-rank claim's, after the record
    # went in under lease 2 (lease 2 revoked: the record vanishes with it). Lease 3 holds both.
    store = LeaseDroppedBeforeCreate(etcd.endpoints, etcd, revoke_at={0, 2})
    rdzv = rendezvous(store, job_id)
    try:
        rdzv.register()
        keys = JobKeys(job_id)
        lease = rdzv.lease.lease_id
        assert len(store.revoked) == 2 and lease not in store.revoked and store.creates == 5
        assert etcd.get(keys.node("a")).lease == lease and etcd.get(keys.node_rank(0)).lease == lease
        assert etcd.lease_ttl(lease) is not None and rdzv.lease_valid()
        assert all(etcd.lease_ttl(old) is None for old in store.revoked)
    finally:
        rdzv.leave()
        store.close()


def test_registration_gives_up_with_one_clear_error(etcd, job_id, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(register, "REGISTER_TRIES_TTLS", 0.5)  # give up after 1.5 s (heartbeat 3 s)
    store = LeaseDroppedBeforeCreate(etcd.endpoints, etcd)  # every lease is gone before its record
    rdzv = rendezvous(store, job_id)
    try:
        with pytest.raises(RendezvousError, match="could not register node 'a': etcd expired each of") as err:
            rdzv.register()
        assert "\n" not in str(err.value) and "heartbeat-timeout" in str(err.value)
        assert rdzv.lease is None and len(store.revoked) >= 2, "it took new leases before giving up"
        assert etcd.get(JobKeys(job_id).node("a")) is None
    finally:
        rdzv.leave()
        store.close()
