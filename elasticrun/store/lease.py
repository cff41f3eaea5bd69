"""A lease kept alive by a background thread, with local expiry for fencing.

etcd clients do not refresh leases on their own. :class:`KeepAlive` refreshes every
``ttl / 3`` seconds and tracks when the lease was last confirmed. If the lease is gone
(etcd says so) or has not been confirmed for a whole TTL (we cannot reach etcd, or the
process was frozen), the lease is treated as lost *locally*: ``on_lost`` fires once, so
the agent can fence itself (stop its workers) before etcd's own expiry is even observed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from elasticrun.errors import StoreError
from elasticrun.store.client import EtcdStore

log = logging.getLogger(__name__)


class KeepAlive:
    """Grant a lease and keep it alive until :meth:`revoke` or loss."""

    def __init__(self, store: EtcdStore, ttl: float, on_lost: Optional[Callable[[str], None]] = None) -> None:
        self.store = store
        self.ttl = max(2, int(round(ttl)))
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lost_reason: Optional[str] = None
        self._lock = threading.Lock()
        self.lease_id = store.grant_lease(self.ttl)
        self._confirmed = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.lease_id:x}", daemon=True)
        self._thread.start()

    @property
    def interval(self) -> float:
        return max(0.2, self.ttl / 3.0)

    def valid(self) -> bool:
        """True while the lease is confirmed within the last TTL (checked against the local clock)."""
        if self._lost_reason is not None:
            return False
        if time.monotonic() - self._confirmed >= self.ttl:
            self._lose(f"lease not confirmed for {self.ttl}s (etcd unreachable or process paused)")
            return False
        return True

    @property
    def lost_reason(self) -> Optional[str]:
        return self._lost_reason

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._lost_reason is not None:
                return
            self._lost_reason = reason
        log.warning("lease %x lost: %s", self.lease_id, reason)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:  # noqa: BLE001 - a callback bug must not kill the heartbeat thread
                log.exception("on_lost callback failed")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.valid():
                return
            sent = time.monotonic()
            try:
                remaining = self.store.refresh_lease(self.lease_id)
            except StoreError as err:
                log.debug("keep-alive failed: %s", err)
                continue
            if self._stop.is_set():
                return
            if remaining <= 0:
                self._lose("etcd expired the lease")
                return
            # Only count the refresh if no full TTL passed before it was sent (a frozen process
            # resumes here with a stale clock: its lease may already have expired in etcd).
            if sent - self._confirmed < self.ttl:
                self._confirmed = sent
            else:
                self._lose("lease not confirmed for a whole TTL")
                return

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease (its keys vanish at once)."""
        self._stop.set()
        try:
            self.store.revoke_lease(self.lease_id)
        except StoreError as err:
            log.debug("revoke failed: %s", err)

    def stop(self) -> None:
        """Stop refreshing without revoking (the lease then expires on its own)."""
        self._stop.set()
