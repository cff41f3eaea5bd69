"""Watches that move off a frozen or partitioned etcd member.

A watch is one long gRPC stream without a deadline. A member that dies closes it (the watch's
``on_error`` runs and its owner watches again, on another member); a member that is frozen
(SIGSTOP, a VM pause) or partitioned keeps it open and silent forever: the calls and lease
keep-alives of the process fail over after their deadlines, but the watch would never deliver
another event. The :class:`WatchDog` of a store sends etcd's progress request on the watch stream
every ``interval`` seconds (etcd answers at once, even when nothing changed); a member that leaves
one unanswered for the store's call deadline is failed over from and the stream is ended, so every
watch on it gets its ``on_error``: its owner reads again — from a member that answers — and
watches from that read's revision, so no change is missed. A stream left behind by a failover
(pyetcd half-closes it, a frozen member never ends it) is ended the same way at the next check.
One thread per store with several endpoints, only while it has watches.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from elasticrun.errors import StoreError

log = logging.getLogger(__name__)


class WatchDog:
    """The watch-stream checker of one :class:`~elasticrun.store.client.EtcdStore` (see the module)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.silence = float(store.timeout)  # as long as any call may wait for its answer
        self.interval = min(1.0, self.silence / 4)
        self.failovers = 0  # how many silent members were left (for tests)
        self._lock = threading.Lock()
        self._running = False
        self._stop = threading.Event()

    def watching(self) -> None:
        """A watch was made: check the streams until none carries a watch (with several members only:
        a single etcd has no other member to move to, and its stream resumes when it does)."""
        with self._lock:
            if self._running or len(self.store._hosts) < 2:
                return
            self._running = True
        threading.Thread(target=self._run, name="etcd-watchdog", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with self.store.using() as client:
                    with self._lock:
                        if not client.watching():
                            self._running = False
                            return
                    silent = client.check_watches(self.silence)
            except StoreError:  # closed
                break
            for member in silent:
                self.failovers += 1
                log.warning("etcd member %s did not answer on the watch stream for %.0f s: watching on "
                            "another member", member, self.silence)
        with self._lock:
            self._running = False
