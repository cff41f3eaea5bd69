"""A lease kept alive by a background thread, with local expiry for fencing and a liveness gate.

etcd clients do not refresh leases on their own. :class:`KeepAlive` is refreshed every
``ttl / 3`` seconds, the first time at a random point of the second half of that (by its store's
:class:`~elasticrun.store.refresher.Refresher`: one thread and one batch per turn for all the leases
of a client that are due) and tracks when it was last confirmed.
Its :meth:`health` is one of:

- ``HELD``: confirmed within the last TTL;
- ``IN_DOUBT``: not confirmed for a TTL *because etcd does not answer* (every refresh
  attempt since the last confirmation failed to reach it, and attempts kept being made):
  an outage. Nobody can write a new round while etcd is unreachable, so the agent may keep
  its workers for a bounded grace (see docs/design.md, "etcd outages");
- ``LOST``: etcd said the lease is gone: the agent must fence itself. ``on_lost`` fires once.
  After a TTL without any refresh attempt (this process was frozen, its loop stalled, or the
  refresh thread was starved) :meth:`health` asks etcd at once instead of trusting the clock:
  etcd never renews an expired lease, so "alive" is safe to believe and "gone" fences.

Liveness: the lease is refreshed only while the owner's main loop makes progress. The
owner calls :meth:`beat` every iteration (and ``beat(busy_for=S)`` before a bounded wait
of up to S seconds). If no beat came for ``stall_after`` seconds the thread stops
refreshing, etcd expires the lease within the TTL, and the other nodes treat this one as
lost — a stalled agent cannot hold up the job with a healthy-looking lease.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from typing import Callable, Optional

from elasticrun.errors import StoreError
from elasticrun.store.client import EtcdStore
from elasticrun.store.refresher import refresher_for

log = logging.getLogger(__name__)
_JITTER = random.Random()  # private: never the global `random` a training script seeds


class LeaseHealth(str, enum.Enum):
    """What this process knows about its lease (see the module docstring)."""

    HELD = "held"
    IN_DOUBT = "in-doubt"
    LOST = "lost"


class KeepAlive:
    """Grant a lease and keep it alive until :meth:`revoke` or loss."""

    def __init__(
        self,
        store: EtcdStore,
        ttl: float,
        on_lost: Optional[Callable[[str], None]] = None,
        stall_after: Optional[float] = None,
    ) -> None:
        self.store = store
        self.ttl = max(2, int(round(ttl)))
        # A main loop silent for this long counts as stalled (None: no liveness gate).
        self.stall_after = stall_after
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lost_reason: Optional[str] = None
        self._lock = threading.Lock()
        # etcd counts the TTL from when it granted the lease, which may be long before its answer reaches
        # a busy process: the lease counts as confirmed when the grant was sent, never later (fencing).
        asked = time.monotonic()
        self.lease_id = store.grant_lease(self.ttl)
        now = time.monotonic()
        self._confirmed = asked
        self._alive_until = now + (stall_after or 0.0)
        self._attempted = now  # last refresh attempt (sent)
        self._pending: Optional[float] = None  # when the refresh now waiting for etcd was sent
        self._unreachable_since: Optional[float] = None  # first failed attempt since the last confirmation
        self.last_unreachable: Optional[float] = None  # last time etcd did not answer a refresh
        self._said_stalled = False
        # When the refresher sends our next keep-alive: the first within the second half of the interval
        # after the grant was sent (at once if its answer came later), so that leases granted at once are
        # refreshed in several smaller batches (earlier is always safe).
        self.next_due = asked + self.interval * (0.5 + 0.5 * _JITTER.random())
        self._refresher = refresher_for(store, self)

    @property
    def interval(self) -> float:
        return max(0.2, self.ttl / 3.0)

    @property
    def refresh_timeout(self) -> float:
        """Deadline of a keep-alive (half a TTL at most: a member that never answers is failed over
        from in time; see ``EtcdStore.refresh_lease``)."""
        return max(1.0, self.ttl / 2.0)

    # -- liveness --------------------------------------------------------------------

    def beat(self, busy_for: float = 0.0) -> None:
        """The owner's loop made progress; ``busy_for``: it now enters a wait bounded by that many seconds."""
        if self.stall_after is not None:  # each beat replaces the last one's promise
            self._alive_until = time.monotonic() + self.stall_after + max(0.0, busy_for)

    def stalled(self) -> bool:
        """True when the owner's loop has not beaten within ``stall_after`` (refreshing stopped)."""
        return self.stall_after is not None and time.monotonic() > self._alive_until

    # -- state -----------------------------------------------------------------------

    def health(self) -> LeaseHealth:
        """HELD, IN_DOUBT (etcd unreachable past a TTL) or LOST; see the module docstring."""
        if self._lost_reason is not None:
            return LeaseHealth.LOST
        now = time.monotonic()
        if now - self._confirmed < self.ttl:
            return LeaseHealth.HELD
        # Unconfirmed for a TTL. An outage if we kept trying and etcd kept not answering.
        since = self._unreachable_since
        pending = self._pending
        if pending is not None and since is None:
            since = pending  # the first attempt since the confirmation is still waiting for etcd
        trying = since is not None and since - self._confirmed < self.ttl and now - self._attempted < self._patience()
        if trying and not self.stalled():
            return LeaseHealth.IN_DOUBT
        # No attempt for a TTL: this process was frozen, its loop stalled, or the refresh thread was
        # starved (a long import holding the GIL). The lease may be gone: ask etcd, now.
        return self._check_now()

    def _check_now(self) -> LeaseHealth:
        """One refresh from the caller's thread: etcd, not the local clock, says if the lease lives."""
        sent = time.monotonic()
        try:
            remaining = self.store.refresh_lease(self.lease_id, timeout=self.refresh_timeout)
        except StoreError:
            self.last_unreachable = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = sent
            self._attempted = sent
            return LeaseHealth.IN_DOUBT
        self._confirm(sent, remaining)
        return LeaseHealth.LOST if self._lost_reason is not None else LeaseHealth.HELD

    def _confirm(self, sent: float, remaining: int) -> None:
        """Record etcd's answer to a refresh sent at ``sent``.

        Alive (``remaining > 0``): the lease is confirmed as of ``sent`` — etcd counts its TTL from
        when it received the refresh, later, so the local deadline ``sent + TTL`` is never later
        than etcd's. etcd never renews an expired lease, so this holds after any gap.
        """
        if remaining <= 0:
            self._lose("etcd expired the lease (process paused, its main loop stalled, or an outage)")
            return
        if sent > self._confirmed:
            self._confirmed = sent
        self._unreachable_since = None

    def _patience(self) -> float:
        """How long since the last attempt still counts as 'still trying' (an attempt may block)."""
        return self.interval + self.store.timeout + self.ttl

    def valid(self) -> bool:
        """True while the lease is confirmed within the last TTL (checked against the local clock)."""
        return self.health() is LeaseHealth.HELD

    def unconfirmed_for(self) -> float:
        """Seconds since etcd last confirmed the lease."""
        return time.monotonic() - self._confirmed

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

    # -- refreshing (called by this store's Refresher thread) ----------------------------------

    def start_refresh(self, sent: float) -> bool:
        """A refresh is due: False when none is to be sent (lost, stopped, or a stalled loop)."""
        if self._lost_reason is not None or self._stop.is_set():
            self._refresher.remove(self)
            return False
        if self.stalled():
            # Do not refresh for a stalled loop: etcd expires the lease, the others re-form.
            if not self._said_stalled:
                log.warning("lease %x: main loop stalled; not refreshing", self.lease_id)
            self._said_stalled = True
            return False
        self._said_stalled = False
        self._attempted = self._pending = sent
        return True

    def refreshed(self, sent: float, remaining: int) -> None:
        """etcd answered the refresh sent at ``sent``."""
        self._pending = None
        if not self._stop.is_set():
            self._confirm(sent, remaining)

    def refresh_failed(self, sent: float, err: StoreError) -> None:
        """The refresh sent at ``sent`` did not reach etcd."""
        self._pending = None
        log.debug("keep-alive failed: %s", err)
        self.last_unreachable = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = sent

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease (its keys vanish at once)."""
        self.stop()
        try:
            self.store.revoke_lease(self.lease_id)
        except StoreError as err:
            log.debug("revoke failed: %s", err)

    def stop(self) -> None:
        """Stop refreshing without revoking (the lease then expires on its own)."""
        self._stop.set()
        self._refresher.remove(self)
