"""A local mirror of one job's etcd keys, kept current by a watch (no polling).

The view reads the job prefix once, then applies watch events. If the watch dies
(etcd restarted, revision compacted) it re-reads and re-watches in the background with
backoff. Callers block in :meth:`wait_change` and then inspect the snapshot helpers.

Node records are parsed once per change (not per look) and the topology once per
revision, so a wake-up costs O(nodes) dict work, not O(nodes) JSON parses. Keys under
``progress/`` (frequent worker reports the protocol never reads) are neither mirrored
nor wake anyone.

Only the agent that leads the rendezvous needs every node record; the others mirror the
job without ``nodes/`` (``nodes=False``, see :meth:`JobView.mirror_nodes`). With etcd the
excluded prefixes are left out of the watches themselves (range watches), so a node that
registers or changes its record costs one watch delivery (the leader's), not one per agent.
Changes on different ranges may arrive in any order: such a view sees ``events/<n>`` and the
topology of round n on separate watches (readers fall back to etcd for the event).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import NodeInfo, Topology, parse_node, parse_topology
from elasticrun.store.client import EtcdStore, KeyValue, Snapshot, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a view that disagrees with etcd may take to catch up (its events in flight) before verify() reads again.
VERIFY_SETTLE_S = 1.0


class JobView:
    """Mirror of ``/elasticrun/<job>/`` with change notification."""

    def __init__(self, store: EtcdStore, keys: JobKeys, nodes: bool = True) -> None:
        self.store = store
        self.keys = keys
        self._with_nodes = nodes
        self._gen = 0  # bumped by every sync: events of older watches are dropped
        self._cancels: List[Callable[[], None]] = []
        self._resyncing = False
        self._error_again = False
        self._data: Dict[str, KeyValue] = {}
        self._nodes: Dict[str, Tuple[NodeInfo, int]] = {}  # parsed nodes/*: node id -> (info, lease)
        self._topo: Tuple[Optional[Topology], int] = (None, 0)  # parsed topology and its mod revision
        self._topo_lock = threading.Lock()
        self._ignored = (keys.progress,)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # any change: the leader waits on this one
        self._job_cond = threading.Condition(lock)  # changes of keys other than node records
        self._version = 0
        self._job_version = 0
        self._revision = 0  # the newest etcd revision this view has read or been sent
        self._members_version = 0  # bumped when a node record appears, vanishes or changes lease
        self._closed = False
        self._healthy = False
        self._sync()

    # -- keeping in sync ----------------------------------------------------------------

    @property
    def mirrors_nodes(self) -> bool:
        """Whether ``nodes/`` is mirrored (see :meth:`mirror_nodes`)."""
        return self._with_nodes

    def mirror_nodes(self, on: bool) -> None:
        """Start or stop mirroring the node records (re-reads the job; raises StoreError)."""
        if on == self._with_nodes:
            return
        self._with_nodes = on
        self._stop_watches()
        try:
            self._sync()
        except StoreError as err:
            self._on_error(err, self._gen)  # re-read and watch in the background, with backoff

    def _skipped(self) -> Tuple[str, ...]:
        return self._ignored if self._with_nodes else (*self._ignored, self.keys.nodes)

    def _ranges(self) -> List[Tuple[str, str]]:
        """The key ranges ``[start, end)`` watched: with the nodes, the whole prefix (one watch, so
        every change arrives in revision order: a round's topology never before the node records
        it was planned from); without, the prefix minus ``nodes/`` and ``progress/``."""
        if self._with_nodes:
            return [(self.keys.prefix, _prefix_end(self.keys.prefix))]
        ranges, start = [], self.keys.prefix
        for skip in sorted(self._skipped()):
            ranges.append((start, skip))
            start = _prefix_end(skip)
        ranges.append((start, _prefix_end(self.keys.prefix)))
        return [(a, b) for a, b in ranges if a < b]

    def _stop_watches(self) -> None:
        with self._cond:
            cancels, self._cancels = self._cancels, []
            self._gen += 1
        for cancel in cancels:
            cancel()

    def _sync(self) -> None:
        ranged = hasattr(self.store, "watch_range")  # else one prefix watch, filtered here
        skipped = self._skipped()
        reads = ([self.store.get_range(a, b) for a, b in self._ranges()] if ranged
                 else [self.store.get_prefix(self.keys.prefix)])
        with self._cond:
            self._gen += 1
            gen = self._gen
            self._data = {}
            self._nodes = {}
            self._revision = max([self._revision] + [rev for _, rev in reads])
            for kvs, _ in reads:
                for kv in kvs:
                    if not kv.key.startswith(skipped):
                        self._put(kv)
            self._healthy = True
            self._members_version += 1
            self._changed(job=True)

        def on_events(events: List[WatchEvent]) -> None:
            self._on_events(events, gen)

        def on_error(err: BaseException) -> None:
            self._on_error(err, gen)

        if ranged:
            for (a, b), (_, revision) in zip(self._ranges(), reads):
                self._cancels.append(self.store.watch_range(a, b, on_events, on_error, revision + 1))
        else:
            revision = reads[0][1]
            self._cancels.append(self.store.watch_prefix(self.keys.prefix, on_events, on_error, revision + 1))

    def _put(self, kv: KeyValue) -> None:
        """Mirror one key (lock held); node records are parsed here, once, and kept in ``_nodes`` only
        (so that looking up the job's other keys never walks the node records)."""
        if not kv.key.startswith(self.keys.nodes):
            self._data[kv.key] = kv
            return
        node_id = kv.key[len(self.keys.nodes):]
        info = parse_node(kv.value, kv.key)  # a malformed record is reported once and counts as absent
        old = self._nodes.get(node_id)
        if info is None:
            self._drop_node(node_id)
            return
        self._nodes[node_id] = (info, kv.lease)
        if old is None or old[1] != kv.lease:
            self._members_version += 1

    def _drop_node(self, node_id: str) -> None:
        if self._nodes.pop(node_id, None) is not None:
            self._members_version += 1

    def _changed(self, job: bool) -> None:
        """Wake the waiters (lock held): all of them, or (``job`` False: only node records changed)
        those that watch the node records."""
        self._version += 1
        self._cond.notify_all()
        if job:
            self._job_version += 1
            self._job_cond.notify_all()

    def _on_events(self, events: List[WatchEvent], gen: int) -> None:
        skipped = self._skipped()
        newest = max((ev.mod_revision for ev in events), default=0)
        events = [ev for ev in events if not ev.key.startswith(skipped)]
        if not events:
            with self._cond:
                if gen == self._gen:
                    self._revision = max(self._revision, newest)
            return
        nodes = self.keys.nodes
        with self._cond:
            if gen != self._gen:
                return  # a watch of an older sync
            self._revision = max(self._revision, newest)
            for ev in events:
                if ev.deleted:
                    if ev.key.startswith(nodes):
                        self._drop_node(ev.key[len(nodes):])
                    else:
                        self._data.pop(ev.key, None)
                else:
                    old = self._data.get(ev.key)
                    self._put(
                        KeyValue(
                            key=ev.key,
                            value=ev.value,
                            mod_revision=ev.mod_revision,
                            create_revision=old.create_revision if old else ev.mod_revision,
                            lease=ev.lease,
                        )
                    )
            self._changed(job=not all(ev.key.startswith(nodes) for ev in events))

    def _on_error(self, err: BaseException, gen: int) -> None:
        with self._cond:
            if self._closed or gen != self._gen:
                return  # closed, or a watch of an older sync (already replaced)
            if self._resyncing:
                self._error_again = True  # a watch of the resync itself died: the loop runs once more
                return
            self._resyncing, self._error_again = True, False
            self._healthy = False
            self._changed(job=True)
        threading.Thread(target=self._resync_loop, name="view-resync", daemon=True).start()

    def _resync_loop(self) -> None:
        delay = 0.1
        while not self._closed:
            self._stop_watches()  # the other ranges' watches too: all restart from one read
            try:
                self._sync()
                log.info("watch on %s re-established", self.keys.prefix)
                with self._cond:
                    if not self._error_again:
                        self._resyncing = False
                        return
                    self._error_again = False
            except StoreError as err:
                log.debug("resync failed: %s", err)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        with self._cond:
            self._resyncing = False

    def resync(self) -> None:
        """Re-read the job now and watch from there (raises StoreError): after a change this agent made
        or read directly in etcd (e.g. a finished job's keys removed), the view shows at least that."""
        self._stop_watches()
        try:
            self._sync()
        except StoreError as err:
            self._on_error(err, self._gen)  # re-read and watch in the background, with backoff
            raise

    def verify(self, keys: Sequence[str], settle: float = VERIFY_SETTLE_S) -> bool:
        """Compare ``keys`` (not node records) with etcd. A view that disagrees and has not caught up within
        ``settle`` seconds missed a change — a watch that etcd ended without a word, an event lost — and reads
        the job again. True when it had to (StoreError when etcd does not answer)."""
        snap = self.store.snapshot(list(keys))
        deadline = time.monotonic() + settle
        with self._cond:
            while self._behind(snap) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            else:
                return False
        log.warning("the view of %s missed a change in etcd (watching again from a new read)", self.keys.prefix)
        self.resync()
        return True

    def _behind(self, snap: Snapshot) -> bool:
        """Whether a key of ``snap`` differs here while the view has not seen ``snap``'s revision (lock held)."""
        if self._revision >= snap.revision:
            return False  # the view is as new as the read or newer: a difference is a later change
        return any(_mod_revision(self._data.get(k)) != _mod_revision(kv) for k, kv in snap.kvs.items())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._changed(job=True)
        self._stop_watches()

    # -- waiting --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Bumped by every change (see :meth:`wait_change`)."""
        return self._version

    @property
    def revision(self) -> int:
        """The newest etcd revision this view has caught up with (its reads' and watch events')."""
        return self._revision

    @property
    def job_version(self) -> int:
        """Bumped by every change but those of node records alone."""
        return self._job_version

    @property
    def members_version(self) -> int:
        """Bumped when a node record appears, vanishes or changes its lease — not when a node updates
        its record: who is registered changed only when this did."""
        return self._members_version

    @property
    def healthy(self) -> bool:
        return self._healthy

    def wait_change(self, since: int, timeout: float, nodes: bool = True) -> int:
        """Block until the view changes after version ``since`` (or ``timeout``); return the version.

        ``nodes=False``: wait for (and return) :attr:`job_version` instead: a change of node records
        alone does not wake us. With many agents sharing one view (the bench), the agents that do not
        lead thus sleep through the N registrations of a round instead of each waking N times.
        """
        cond = self._cond if nodes else self._job_cond
        with self._cond:
            if (self._version if nodes else self._job_version) == since and not self._closed:
                cond.wait(timeout)
            return self._version if nodes else self._job_version

    def poke(self) -> None:
        """Wake up waiters (e.g. a local event such as a worker exit)."""
        with self._cond:
            self._changed(job=True)

    # -- snapshot helpers -----------------------------------------------------------------

    def get(self, key: str) -> Optional[KeyValue]:
        with self._cond:
            return self._data.get(key)

    def record(self, key: str, check: records.Check[T]) -> Optional[T]:
        """The record at ``key`` checked by ``check`` (an :mod:`elasticrun.job.records` check); None when
        absent or malformed (reported once and ignored: another agent's bad value never crashes this one)."""
        return records.read(self.get(key), check)

    def under(self, prefix: str) -> Dict[str, KeyValue]:
        with self._cond:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    def nodes(self) -> Dict[str, Tuple[NodeInfo, int]]:
        """Registered nodes: node id → (info, lease id). A copy; the infos are immutable."""
        with self._cond:
            return dict(self._nodes)

    def node_count(self) -> int:
        """How many nodes are registered (cheap)."""
        return len(self._nodes)

    def topology(self) -> Tuple[Optional[Topology], int]:
        """The current round and its mod revision (0 when no round was formed yet)."""
        kv = self.get(self.keys.topology)
        if kv is None:
            return None, 0
        cached, rev = self._topo
        if rev == kv.mod_revision:
            return cached, rev
        with self._topo_lock:  # parsed once per revision, however many agents share this view
            cached, rev = self._topo
            if rev == kv.mod_revision:
                return cached, rev
            topo = parse_topology(kv.value, kv.key)  # frozen: safe to share between callers
            if topo is None:
                # A malformed round record (reported once): keep the last good round (the next round's
                # transaction, which compares this revision, replaces it).
                topo = cached
            self._topo = (topo, kv.mod_revision)
        return topo, kv.mod_revision

    def state(self) -> Optional[Dict[str, Any]]:
        """The job's terminal state record, if it has ended (a malformed one counts as absent)."""
        return self.record(self.keys.state, records.state_record)


def _mod_revision(kv: Optional[KeyValue]) -> int:
    return kv.mod_revision if kv is not None else 0


def _prefix_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (``a/`` → ``a0``; ASCII keys)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
