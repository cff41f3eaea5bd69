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

import logging
import threading
import time
from typing import Any, Dict, List, Protocol, Sequence

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
        self._leases: List[Refreshable] = []
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keepalive", daemon=True)
        self.batches = 0  # how many batches were sent (for tests and benches)

    def remove(self, lease: Refreshable) -> None:
        with _LOCK:
            if lease in self._leases:
                self._leases.remove(lease)
        self._wake.set()

    def _refresh(self, ids: Sequence[int], timeout: float) -> Dict[int, int]:
        many = getattr(self.store, "refresh_leases", None)
        if many is not None:
            return dict(many(ids, timeout))
        return {i: self.store.refresh_lease(i) for i in ids}

    def _run(self) -> None:
        while True:
            with _LOCK:
                if not self._leases:
                    if _REFRESHERS.get(id(self.store)) is self:
                        del _REFRESHERS[id(self.store)]
                    return
                leases = list(self._leases)
            now = time.monotonic()
            due = [ka for ka in leases if ka.next_due <= now + COALESCE_S]
            if not due:
                self._wake.wait(max(0.0, min(ka.next_due for ka in leases) - now))
                self._wake.clear()
                continue
            for ka in due:  # each lease keeps its phase: leases granted at once stay spread over the interval
                ka.next_due = max(ka.next_due + ka.interval, now + ka.interval / 2)
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
        ref._leases.append(lease)
    if start:
        ref._thread.start()
    ref._wake.set()
    return ref
