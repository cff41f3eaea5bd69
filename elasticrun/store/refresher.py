"""One keep-alive thread per etcd client: every lease of the process refreshed in one batch.

A real node runs one agent and holds one lease; a process that simulates hundreds of agents
(the rendezvous bench, tests) holds hundreds. One thread and one gRPC stream per lease would
cost that process a thread switch and a stream set-up per lease and turn — work that grows
with the number of leases and starves their refreshes. Here every
:class:`~elasticrun.store.lease.KeepAlive` of a client joins that client's :class:`Refresher`:
one thread sends the keep-alives that are due (``EtcdStore.refresh_leases``: a few streams side by
side for hundreds of leases) and hands each lease its answer. Leases granted at once (a burst of
registrations) are due at spread times (see ``KeepAlive``) and keep their phase, so that a turn sends
the leases of a fraction of the interval, not every lease of the process at once. A store without
``refresh_leases`` is refreshed one lease at a time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Any, Dict, List, Protocol, Sequence, Tuple

from elasticrun.errors import StoreError

log = logging.getLogger(__name__)


class Refreshable(Protocol):
    """What the refresher needs from a lease (see :class:`~elasticrun.store.lease.KeepAlive`)."""

    lease_id: int
    next_due: float

    @property
    def interval(self) -> float: ...

    @property
    def refresh_timeout(self) -> float: ...

    def start_refresh(self, sent: float) -> bool: ...

    def refreshed(self, sent: float, remaining: int) -> None: ...

    def refresh_failed(self, sent: float, err: StoreError) -> None: ...


# Leases due within this many seconds of the first go in the same batch.
COALESCE_S = 0.2
_LOCK = threading.Lock()
_REFRESHERS: Dict[int, Refresher] = {}  # id(store) -> its refresher, while it has leases


class Refresher:
    """The keep-alive thread of one store (see the module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        # Every lease by when it is due next: a turn costs O(due x log leases), not a scan of all leases.
        self._due: List[Tuple[float, int, Refreshable]] = []  # heap of (next_due, entry number, lease)
        self._entry: Dict[Refreshable, int] = {}  # lease -> number of its live entry in the heap
        self._numbers = itertools.count()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keepalive", daemon=True)
        self.batches = 0  # how many batches were sent (for tests and benches)

    def _schedule(self, lease: Refreshable) -> None:
        """(Re)enter ``lease`` at its ``next_due``; its older entry, if any, is skipped when popped. Under _LOCK."""
        number = next(self._numbers)
        self._entry[lease] = number
        heapq.heappush(self._due, (lease.next_due, number, lease))

    def remove(self, lease: Refreshable) -> None:
        with _LOCK:
            self._entry.pop(lease, None)  # its heap entry is dropped when it comes up
            empty = not self._entry
        if empty:
            self._wake.set()  # the thread ends

    def _refresh(self, ids: Sequence[int], timeout: float) -> Dict[int, int]:
        many = getattr(self.store, "refresh_leases", None)
        if many is not None:
            return dict(many(ids, timeout))
        return {i: self.store.refresh_lease(i) for i in ids}

    def _take_due(self, now: float) -> Tuple[List[Refreshable], float]:
        """The leases due by ``now`` + COALESCE_S (out of the heap), and how long until the next one."""
        due: List[Refreshable] = []
        heap = self._due
        while heap and heap[0][0] <= now + COALESCE_S:
            _, number, lease = heapq.heappop(heap)
            if self._entry.get(lease) == number:
                due.append(lease)
        return due, (heap[0][0] - now if heap else 0.0)

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before looking: a lease added from now on wakes the wait below
            with _LOCK:
                if not self._entry:
                    if _REFRESHERS.get(id(self.store)) is self:
                        del _REFRESHERS[id(self.store)]
                    return
                now = time.monotonic()
                due, until_next = self._take_due(now)
            if not due:
                self._wake.wait(max(0.0, until_next))
                continue
            with _LOCK:
                for ka in due:  # each lease keeps its phase: leases granted at once stay spread over the interval
                    ka.next_due = max(ka.next_due + ka.interval, now + ka.interval / 2)
                    if ka in self._entry:
                        self._schedule(ka)
            sent = time.monotonic()
            batch = [ka for ka in due if ka.start_refresh(sent)]
            if not batch:
                continue
            self.batches += 1
            try:
                answers = self._refresh([ka.lease_id for ka in batch], min(ka.refresh_timeout for ka in batch))
            except StoreError as err:
                log.debug("keep-alive of %d lease(s) failed: %s", len(batch), err)
                for ka in batch:
                    ka.refresh_failed(sent, err)
                continue
            for ka in batch:  # only etcd's answer "gone" (TTL <= 0) loses a lease; no answer is a failure
                if ka.lease_id in answers:
                    ka.refreshed(sent, answers[ka.lease_id])
                else:
                    ka.refresh_failed(sent, StoreError("etcd did not answer this keep-alive"))


def refresher_for(store: Any, lease: Refreshable) -> Refresher:
    """Join ``lease`` to the refresher of ``store`` (started on first use, ended with its last lease)."""
    with _LOCK:
        ref = _REFRESHERS.get(id(store))
        start = ref is None or ref.store is not store
        if start:
            ref = _REFRESHERS[id(store)] = Refresher(store)
        ref._schedule(lease)
    if start:
        ref._thread.start()
    ref._wake.set()
    return ref
