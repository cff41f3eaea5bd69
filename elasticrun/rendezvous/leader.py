"""Which agent watches every node record: the holder of the job's ``leader`` key.

Forming a round needs every node's record (who waits, who still runs workers), and so does
noticing that a member died or that a newcomer arrived. If every agent watched all node
records, N agents joining would cost N² watch deliveries (each registration and each record
update reaches every agent). Instead one agent, the leader, holds ``leader`` (create-if-absent,
on its lease) and mirrors ``nodes/``; the others mirror the job without it and learn what
they need from the keys the leader writes: the topology, ``rounds/<n>/end`` (a member lost,
newcomers after the stability window) and ``rounds/<n>/joining``.

The key vanishes with the leader's lease (death or leave): every agent sees that (one key,
one delivery each), the first ``create`` wins, and the winner starts mirroring the nodes.
"""

from __future__ import annotations

import logging
from typing import Optional

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import EtcdStore
from elasticrun.store.types import Guard, KeyValue

log = logging.getLogger(__name__)


class Leadership:
    """One agent's claim on the ``leader`` key; switches its view's node mirror to match."""

    def __init__(self, store: EtcdStore, keys: JobKeys, view: JobView, node_id: str) -> None:
        self.store = store
        self.keys = keys
        self.view = view
        self.node_id = node_id
        self.leads = False  # as of the last claim
        # The leader key as our last read found it, held by another agent: believed while our view has not
        # caught up with its revision (a view seconds behind must not cost a read per loop turn).
        self._read: Optional[KeyValue] = None

    def holder(self) -> Optional[str]:
        """The node id in the leader key as our view has it (None when nobody leads)."""
        kv = self.view.get(self.keys.leader)
        return None if kv is None else kv.value.decode(errors="replace")

    def _drop_leaseless(self, kv: KeyValue) -> Optional[KeyValue]:
        """A leader key on no lease was not written by an agent (a foreign client, by hand): it would
        never expire, so nobody would lead again. Report it once and remove it (if still as read)."""
        records.report(kv.key, "not held on an agent's lease (written by hand?); removed so that a node can lead")
        try:
            self.store.txn([Guard(kv.key, kv.mod_revision)], deletes=[kv.key])
        except StoreError as err:
            log.debug("could not remove the leader key: %s", err)
            return kv
        return None

    def claim(self, lease_id: Optional[int]) -> bool:
        """Lead when nobody does; True while the key is ours (then the view mirrors every node)."""
        if lease_id is None:
            self.leads = False
            return False
        kv = self._known()
        if kv is not None and not kv.lease:
            kv = self._drop_leaseless(kv)
        if kv is None:
            taken = self._take(lease_id)
            if taken is None:  # our lease just ended (we leave, or lost it): the caller finds out
                self.leads = False
                return False
            mine = taken
            if mine and not self.view.mirrors_nodes:
                log.info("%s leads the rendezvous (watches every node record)", self.node_id)
        else:
            mine = kv.lease == lease_id
        self.view.mirror_nodes(mine)
        self.leads = mine
        return mine

    def _known(self) -> Optional[KeyValue]:
        """The leader key as our view has it, or as our last read found it while the view is behind that read."""
        kv = self.view.get(self.keys.leader)
        if kv is None and self._read is not None and self.view.revision < self._read.mod_revision:
            return self._read
        return kv

    def _take(self, lease_id: int) -> Optional[bool]:
        """Create the leader key on ``lease_id`` if etcd has none; whether it is ours (None: etcd refused)."""
        try:
            # A read first: when N agents find the key gone at once (the job starts, the leader died),
            # a read that sees the winner's key costs etcd no raft entry, a failed create does.
            held = self.store.get(self.keys.leader)
            mine = False
            if held is None:
                mine = self.store.create(self.keys.leader, self.node_id, lease=lease_id)
                if not mine:  # another agent won, or our create went through and its reply was lost
                    held = self.store.get(self.keys.leader)
            mine = mine or (held is not None and held.lease == lease_id)
        except StoreError as err:
            log.debug("could not claim the leader key: %s", err)
            return None
        self._read = None if mine else held
        return mine
