"""What a job leaves in etcd when it ends, and for how long.

* The last node to leave a job that has no outcome yet (every node was signalled, or gave up
  waiting for nodes) records ``state`` = ``stopped`` (:func:`stop_if_last`): ``elasticrun status``
  shows the job ended, ``status --watch`` ends, and a new job may take the id at once
  (:mod:`elasticrun.rendezvous.reuse`).
* Every node leaving a job that ended puts the job's keys that have no lease on one lease of
  ``--ended-job-ttl`` seconds (:func:`expire`; ``expiry`` names the lease, on the lease itself), so
  an ended job's keys — its command line among them — expire from a shared etcd instead of piling
  up. Several nodes do it at once without harm: each batch is a transaction guarded on every key's
  revision, so a key another node already moved is left alone.
"""

from __future__ import annotations

import json
import math
import time
from typing import Iterator, List, Optional, Sequence

from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import topology_record
from elasticrun.rendezvous.states import JobState
from elasticrun.store.client import EtcdStore
from elasticrun.store.types import Guard, KeyValue

ETCD_MAX_TTL = 9_000_000_000  # seconds: the longest lease etcd grants
_BATCH_KEYS = 64  # keys per transaction (etcd's --max-txn-ops is 128 by default)
_BATCH_BYTES = 512 << 10  # bytes per transaction (etcd's request limit is 1.5 MiB by default)
_PASSES = 3  # a pass whose batches lost a race with another node reads the job again


def stop_if_last(store: EtcdStore, keys: JobKeys, reason: str, exit_code: Optional[int] = None,
                 guards: Sequence[Guard] = ()) -> bool:
    """Record that the job stopped, when no node is registered and it has no outcome; True when written.

    Guarded on ``nodes/`` empty, ``state`` as read and ``guards`` (the ``config`` this node joined
    under: a job that replaced ours is never marked).
    """
    snap = store.snapshot([keys.state, keys.topology], [keys.nodes])
    state_kv = snap.kvs[keys.state]
    if snap.counts[keys.nodes] or records.read(state_kv, records.state_record) is not None:
        return False
    topo = records.read(snap.kvs[keys.topology], topology_record)
    record = {"state": JobState.STOPPED.value, "reason": reason, "round": -1 if topo is None else topo.round,
              "time": time.time()}
    if exit_code is not None:
        record["exit_code"] = int(exit_code)
    return store.txn([Guard.unchanged(state_kv, keys.state), Guard.empty(keys.nodes), *guards],
                     [(keys.state, json.dumps(record), None)])


def expire(store: EtcdStore, keys: JobKeys, node_id: str, ttl: float) -> int:
    """Put the keys of ended job ``keys`` that have no lease on its expiry lease (made by the first node
    to get here, ``ttl`` seconds); how many keys this call moved. Nothing while the job runs."""
    lease = _expiry_lease(store, keys, node_id, ttl)
    if lease is None:
        return 0
    moved = 0
    for _ in range(_PASSES):
        kvs, _ = store.get_prefix(keys.prefix)
        loose = [kv for kv in kvs if not kv.lease]
        raced = False
        for batch in _batches(loose):
            if store.txn([Guard(kv.key, kv.mod_revision) for kv in batch], [(kv.key, kv.value, lease) for kv in batch]):
                moved += len(batch)
            else:
                raced = True  # another node moved (or changed) one of these: read again
        if not raced:
            break
    return moved


def _expiry_lease(store: EtcdStore, keys: JobKeys, node_id: str, ttl: float) -> Optional[int]:
    """The job's expiry lease, made (and recorded under ``expiry``) when it has none; None while it runs."""
    for _ in range(_PASSES):
        snap = store.snapshot([keys.state, keys.expiry])
        if records.read(snap.kvs[keys.state], records.state_record) is None:
            return None
        known = records.read(snap.kvs[keys.expiry], records.expiry_record)
        if known is not None and store.lease_ttl(known["lease"]) is not None:
            return int(known["lease"])
        seconds = int(min(ETCD_MAX_TTL, max(1, math.ceil(ttl))))
        lease = store.grant_lease(seconds)
        record = {"lease": lease, "ttl": seconds, "time": time.time(), "by": node_id}
        if store.txn([Guard.unchanged(snap.kvs[keys.state], keys.state),
                      Guard.unchanged(snap.kvs[keys.expiry], keys.expiry)],
                     [(keys.expiry, json.dumps(record), lease)]):
            return lease
        store.revoke_lease(lease)  # another node recorded one first (or the job's keys went): look again
    return None


def _batches(kvs: List[KeyValue]) -> Iterator[List[KeyValue]]:
    batch: List[KeyValue] = []
    size = 0
    for kv in kvs:
        if batch and (len(batch) >= _BATCH_KEYS or size + len(kv.value) > _BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(kv)
        size += len(kv.key) + len(kv.value)
    if batch:
        yield batch


__all__ = ["ETCD_MAX_TTL", "expire", "stop_if_last"]
