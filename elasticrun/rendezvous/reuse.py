"""Starting a job under an id that may be in use: join the job there, or take over an ended one's id.

A node that starts reads the id's ``config``, ``state`` and how many nodes are registered, in one
request (:func:`read_head`), and :func:`assess` says what it found:

=============  =====================================================================  ==========================
finding        what is under the id                                                   what the node does
=============  =====================================================================  ==========================
``FREE``       no settings record                                                     creates ours
``SAME``       a job with our settings that has not ended                             joins it
``DIFFERENT``  a job with other settings, nodes registered                            refuses (ConfigError)
``ENDED``      a job that ended (succeeded, failed, stopped) and no node registered   removes its keys
``ENDING``     a job that ended, its nodes still leaving                              waits for them
``ORPHANED``   other settings, no end recorded, no node registered (lost nodes)       waits a grace, then removes
``MALFORMED``  a settings record that is not a JSON object, no node registered        replaces it
=============  =====================================================================  ==========================

Every removal and creation is one transaction guarded on what was read (the ``state`` and ``config``
revisions, and ``nodes/`` empty), so two nodes starting together never both act on the same
finding; the loser reads again. The node then registers with a transaction guarded on the
``config`` and ``state`` it checked (:meth:`Head.guards`): a job replaced between the check and the
registration makes the registration fail, and the node checks again. So a node never runs in a job
whose settings differ from its own (without ``--heterogeneous``), and an ended job's keys never
block a new job.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import ConfigError, RendezvousError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.settings import describe_mismatch
from elasticrun.store.client import EtcdStore
from elasticrun.store.types import Guard, KeyValue

log = logging.getLogger(__name__)


class Finding(str, enum.Enum):
    """What a starting node found under its job id (see the module doc)."""

    FREE = "free"
    SAME = "same"
    DIFFERENT = "different"
    ENDED = "ended"
    ENDING = "ending"
    ORPHANED = "orphaned"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class Head:
    """What decides whether a job id can be used: its settings, end and registered nodes, at one revision."""

    config_kv: Optional[KeyValue]
    state_kv: Optional[KeyValue]
    topology_kv: Optional[KeyValue]
    expiry_kv: Optional[KeyValue]
    nodes: int
    revision: int

    @property
    def config(self) -> Optional[Dict[str, Any]]:
        """The settings record (None when absent or malformed: reported once)."""
        return records.read(self.config_kv, records.config_record)

    @property
    def state(self) -> Optional[Dict[str, Any]]:
        """The job's end (None while it runs; a malformed record counts as absent)."""
        return records.read(self.state_kv, records.state_record)

    def guards(self, keys: JobKeys) -> List[Guard]:
        """A registration holds only while ``config`` and ``state`` are as read (the job was not replaced)."""
        return [Guard.unchanged(self.config_kv, keys.config), Guard.unchanged(self.state_kv, keys.state)]


def read_head(store: EtcdStore, keys: JobKeys) -> Head:
    """The id's :class:`Head`, in one request."""
    snap = store.snapshot([keys.config, keys.state, keys.topology, keys.expiry], [keys.nodes])
    kvs = snap.kvs
    return Head(kvs[keys.config], kvs[keys.state], kvs[keys.topology], kvs[keys.expiry], snap.counts[keys.nodes],
                snap.revision)


def assess(config: Optional[Dict[str, Any]], config_present: bool, state: Optional[Dict[str, Any]], nodes: int,
           mine: Dict[str, Any]) -> Finding:
    """What a node with settings ``mine`` finds (a pure decision; see the module doc). ``config`` is the
    parsed settings record (None when absent or malformed), ``state`` the parsed end (None while the job
    runs), ``nodes`` how many nodes are registered."""
    if state is not None:
        return Finding.ENDING if nodes else Finding.ENDED
    if not config_present:
        return Finding.FREE
    if config is None:
        return Finding.DIFFERENT if nodes else Finding.MALFORMED
    if not describe_mismatch(config, mine):
        return Finding.SAME
    return Finding.DIFFERENT if nodes else Finding.ORPHANED


class JobClaim:
    """One node's claim on its job id: :meth:`run` loops over :func:`assess` until it may join."""

    def __init__(self, store: EtcdStore, keys: JobKeys, mine: Dict[str, Any], timeout: float, grace: float,
                 say: Callable[[str], None]) -> None:
        self.store = store
        self.keys = keys
        self.mine = mine
        self.timeout = timeout  # --join-timeout: how long we wait for an ended job's nodes to leave
        self.grace = grace  # how long an orphaned job's nodes may take to come back (an etcd outage)
        self.say = say
        self._changed = threading.Event()
        self._cancel: Optional[Callable[[], None]] = None
        self._told = ""

    def run(self) -> Head:
        """Create or find our settings record; the :class:`Head` to guard our registration on.

        Raises ConfigError when a running job has other settings, RendezvousError (retryable) when
        an ended job's nodes do not leave within the timeout.
        """
        started = time.monotonic()
        orphaned_since: Optional[float] = None
        try:
            while True:
                self._changed.clear()
                head = read_head(self.store, self.keys)
                finding = assess(head.config, head.config_kv is not None, head.state, head.nodes, self.mine)
                if finding is Finding.SAME:
                    return head
                if finding is Finding.DIFFERENT:
                    raise ConfigError(self._mismatch(head))
                if finding is Finding.FREE or finding is Finding.MALFORMED:
                    self._create(head)
                elif finding is Finding.ENDED:
                    self._remove(head, f"the job that used it ended ({_ended(head.state)})")
                elif finding is Finding.ORPHANED:
                    orphaned_since = orphaned_since or time.monotonic()
                    waited = time.monotonic() - orphaned_since
                    if waited >= self.grace:
                        self._remove(head, "no node of the job that used it came back within "
                                           f"{self.grace:.0f}s (its nodes were lost)")
                        continue
                    self._tell(f"job {self.keys.job_id!r} has other settings and no registered node (its nodes were "
                               f"lost); waiting up to {self.grace:.0f}s for one to come back before reusing the id")
                    self._wait(self.grace - waited)
                else:  # ENDING
                    left = self.timeout - (time.monotonic() - started)
                    if left <= 0:
                        raise RendezvousError(
                            f"job {self.keys.job_id!r} ended ({_ended(head.state)}) but {head.nodes} of its node(s) "
                            f"are still registered after {self.timeout:.0f}s (--join-timeout); try again when they "
                            "have left, or use another --rdzv-id"
                        )
                    self._tell(f"job {self.keys.job_id!r} ended ({_ended(head.state)}); waiting for its "
                               f"{head.nodes} node(s) to leave before starting a new job under this id")
                    self._wait(left)
        finally:
            if self._cancel is not None:
                self._cancel()

    # -- steps -------------------------------------------------------------------------------

    def _create(self, head: Head) -> None:
        """Write our settings where there are none (or a malformed record, which nobody can check against)."""
        if head.config_kv is not None:
            log.warning("replacing the malformed settings record of job %s", self.keys.job_id)
        self.store.txn(head.guards(self.keys), [(self.keys.config, json.dumps(self.mine, sort_keys=True), None)])

    def _remove(self, head: Head, why: str) -> None:
        """Remove every key of the job that used our id, if nothing changed since ``head`` was read."""
        guards = [*head.guards(self.keys), Guard.unchanged(head.topology_kv, self.keys.topology),
                  Guard.empty(self.keys.nodes)]
        if self.store.txn(guards, delete_prefixes=[self.keys.prefix]):
            self.say(f"reusing job id {self.keys.job_id!r}: {why}; removed its keys")
            expiry = records.read(head.expiry_kv, records.expiry_record)
            if expiry is not None:  # the lease its keys were put on holds nothing now
                self.store.revoke_lease(expiry["lease"])

    def _mismatch(self, head: Head) -> str:
        if head.config is None:
            return (f"job {self.keys.job_id!r} runs with a malformed settings record ({self.keys.config}): this "
                    "node's settings cannot be checked against it; use another --rdzv-id")
        return (f"job {self.keys.job_id!r} runs with different settings ({describe_mismatch(head.config, self.mine)}); "
                "start this node with the same flags as the others, or use another --rdzv-id")

    def _tell(self, message: str) -> None:
        if message != self._told:
            self.say(message)
            self._told = message

    def _wait(self, timeout: float) -> None:
        """Until a key of the job changes (watched), at most ``timeout`` s (and 1 s, to look again)."""
        if self._cancel is None:
            self._cancel = self.store.watch_prefix(self.keys.prefix, lambda _ev: self._changed.set(),
                                                   lambda _err: self._changed.set())
        self._changed.wait(max(0.05, min(timeout, 1.0)))


def _ended(state: Optional[Dict[str, Any]]) -> str:
    state = state or {}
    reason = state.get("reason")
    return f"{state.get('state', 'ended')}{': ' + str(reason) if reason else ''}"


__all__ = ["Finding", "Head", "JobClaim", "assess", "read_head"]
