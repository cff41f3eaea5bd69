"""Registration: take a lease and publish the node record (and ``--node-rank`` claim) under it.

Granting a lease and writing under it are two requests. When more than the heartbeat passes
between them (a slow etcd, an overloaded machine), etcd has expired the lease and refuses the
write (``requested lease not found``, :class:`~elasticrun.errors.LeaseGoneError`); every key
under it is gone too. Registration then takes a new lease and writes again, for at most
:data:`REGISTER_TRIES_TTLS` heartbeats, and gives up with one :class:`RendezvousError`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Sequence

from elasticrun.errors import ConfigError, LeaseGoneError, RendezvousError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.rendezvous.settings import JobChanged, RendezvousSettings
from elasticrun.store.client import EtcdStore
from elasticrun.store.lease import KeepAlive
from elasticrun.store.types import Guard

log = logging.getLogger(__name__)

# A lease that expires before our node record reaches etcd is replaced for this many heartbeats.
REGISTER_TRIES_TTLS = 6


def register_node(
    store: EtcdStore,
    keys: JobKeys,
    settings: RendezvousSettings,
    node: NodeInfo,
    on_lost: Callable[[str], None],
    wait_for_old: bool = False,
    guards: Sequence[Guard] = (),
) -> KeepAlive:
    """Take a lease, publish ``node``'s record under it and return the lease (kept alive).

    A record with our id held by another lease means another agent uses our id (ConfigError)
    — unless ``wait_for_old``: then it is our own previous incarnation, and we wait for its
    lease to expire. A lease etcd dropped before the record reached it is replaced (see the
    module docstring). The record is written only while every one of ``guards`` holds (the job's
    settings and end as the node checked them); JobChanged when one does not (the lease is revoked).
    """
    ttl = settings.heartbeat_timeout
    started = time.monotonic()
    tries = 0
    while True:
        lease = KeepAlive(store, ttl, on_lost=on_lost, stall_after=settings.stall_after)
        tries += 1
        try:
            _create_record(store, keys, settings, node, lease, wait_for_old, guards)
            _claim_node_rank(store, keys, settings, node, lease)
            return lease
        except JobChanged:
            lease.revoke()
            raise
        except LeaseGoneError as err:
            lease.stop()  # etcd has dropped it, and every key under it
            waited = time.monotonic() - started
            if waited > REGISTER_TRIES_TTLS * ttl:
                raise RendezvousError(
                    f"could not register node {node.node_id!r}: etcd expired each of {tries} new leases before "
                    f"the node record reached it ({waited:.0f}s; {err}); etcd or this machine is overloaded: give "
                    "etcd more CPU, or raise --heartbeat-timeout"
                ) from None
            log.warning("node %s: lease %x expired before the node record was written; taking a new lease",
                        node.node_id, lease.lease_id)


def _create_record(
    store: EtcdStore, keys: JobKeys, settings: RendezvousSettings, node: NodeInfo, lease: KeepAlive,
    wait_for_old: bool, guards: Sequence[Guard],
) -> None:
    """Create our node record under ``lease`` while ``guards`` hold; LeaseGoneError when etcd no longer
    knows the lease, JobChanged when a guard does not hold."""
    key = keys.node(node.node_id)
    ttl = settings.heartbeat_timeout
    record = json.dumps(node.replace(heartbeat_at=time.time()).to_dict())
    deadline = time.monotonic() + ttl + 5
    lease.beat(busy_for=ttl + 5)  # the wait below is bounded by that
    while not store.txn([Guard.absent(key), *guards], [(key, record, lease.lease_id)]):
        mine = store.get(key)
        if mine is None:
            if guards and not _hold(store, guards):
                raise JobChanged(key)
            continue  # gone meanwhile (an old record expired): try again
        if mine.lease == lease.lease_id:
            break  # our create went through but its reply was lost; the store's retry then saw the key
        if not wait_for_old:
            lease.revoke()
            raise ConfigError(
                f"node id {node.node_id!r} is already registered in job {settings.job_id!r} by a "
                "running agent; give every node a unique --node-id"
            )
        try:
            store.wait_for(key, lambda kv: kv is None, max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            lease.revoke()
            raise RendezvousError(
                f"could not re-register node {node.node_id!r}: its old record never expired"
            ) from None


def _hold(store: EtcdStore, guards: Sequence[Guard]) -> bool:
    """Whether every (key) guard holds now."""
    snap = store.snapshot([g.key for g in guards])
    return all((snap.kvs[g.key].mod_revision if snap.kvs[g.key] is not None else 0) == g.mod_revision for g in guards)


def _claim_node_rank(
    store: EtcdStore, keys: JobKeys, settings: RendezvousSettings, node: NodeInfo, lease: KeepAlive
) -> None:
    """``--node-rank R``: hold ``node-ranks/R`` under our lease; a second node with R is refused."""
    rank = node.node_rank
    if rank < 0:
        return
    key = keys.node_rank(rank)
    if store.create(key, node.node_id, lease=lease.lease_id):
        return
    holder = store.get(key)
    if holder is not None and holder.lease == lease.lease_id:
        return
    if holder is not None and not holder.lease:  # on no lease: no agent wrote it, and it would never expire
        records.report(key, "not held on an agent's lease (written by hand?); replaced by this node's claim")
        if store.cas(key, node.node_id, holder.mod_revision, lease=lease.lease_id):
            return
        holder = store.get(key)
    lease.revoke()
    owner = holder.value.decode(errors="replace") if holder is not None else "another node"
    raise ConfigError(
        f"--node-rank {rank} is already taken in job {settings.job_id!r} by node {owner!r}; give every "
        "node its own --node-rank (0 .. nnodes-1)"
    )
