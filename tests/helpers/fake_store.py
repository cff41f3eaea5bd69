"""An in-memory stand-in for :class:`elasticrun.store.client.EtcdStore`, for unit tests of the
rendezvous protocol (the integration tests keep a real etcd).

Same semantics where the protocol relies on them: a global revision, create/mod revisions,
compare-and-swap, prefix watches from a revision (events delivered on a thread, like the real
client's), and leases whose keys vanish when the lease is revoked or :meth:`expire`d.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from elasticrun.store.client import KeyValue, WatchEvent
from elasticrun.store.types import Guard, Snapshot


class FakeStore:
    """Thread-safe in-memory key/value store with leases and watches."""

    endpoints = "fake:0"
    timeout = 1.0
    retry_timeout = 1.0

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._kv: Dict[str, KeyValue] = {}
        self._rev = 1
        self._leases: Dict[int, int] = {}  # id -> ttl
        self._ids = itertools.count(0x1000)
        self._watches: Dict[int, Tuple[str, Callable[[List[WatchEvent]], None]]] = {}
        self._events: queue.Queue[Optional[Tuple[int, List[WatchEvent]]]] = queue.Queue()
        self._history: List[WatchEvent] = []
        self._thread = threading.Thread(target=self._deliver, name="fake-store-watch", daemon=True)
        self._thread.start()

    # -- writes (lock held) ---------------------------------------------------------------

    def _write(self, key: str, value: Any, lease: Optional[int]) -> WatchEvent:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._rev += 1
        old = self._kv.get(key)
        self._kv[key] = KeyValue(key, data, self._rev, old.create_revision if old else self._rev, lease or 0)
        return WatchEvent(key, data, False, self._rev, lease or 0)

    def _remove(self, key: str) -> WatchEvent:
        del self._kv[key]
        self._rev += 1
        return WatchEvent(key, b"", True, self._rev)

    def _publish(self, events: List[WatchEvent]) -> None:
        if not events:
            return
        self._history.extend(events)
        for wid, (prefix, _) in list(self._watches.items()):
            mine = [ev for ev in events if ev.key.startswith(prefix)]
            if mine:
                self._events.put((wid, mine))

    def _deliver(self) -> None:
        while True:
            item = self._events.get()
            if item is None:
                return
            wid, batch = item
            with self._lock:
                watch = self._watches.get(wid)
            if watch is not None:
                watch[1](batch)

    def _guard_ok(self, key: str, rev: int) -> bool:
        kv = self._kv.get(key)
        return kv is None if rev == 0 else kv is not None and kv.mod_revision == rev

    # -- the EtcdStore API the protocol uses ---------------------------------------------------

    def get(self, key: str) -> Optional[KeyValue]:
        with self._lock:
            return self._kv.get(key)

    def get_json(self, key: str) -> Any:
        kv = self.get(key)
        return None if kv is None else json.loads(kv.value)

    def get_prefix(self, prefix: str) -> Tuple[List[KeyValue], int]:
        with self._lock:
            return sorted((kv for k, kv in self._kv.items() if k.startswith(prefix)), key=lambda kv: kv.key), self._rev

    def put(self, key: str, value: Any, lease: Optional[int] = None) -> int:
        with self._lock:
            ev = self._write(key, value, lease)
            self._publish([ev])
            return ev.mod_revision

    def put_json(self, key: str, value: Any, lease: Optional[int] = None) -> int:
        return self.put(key, json.dumps(value, sort_keys=True), lease)

    def create(self, key: str, value: Any, lease: Optional[int] = None) -> bool:
        return self.cas(key, value, 0, lease)

    def cas(self, key: str, value: Any, mod_revision: int, lease: Optional[int] = None) -> bool:
        with self._lock:
            if not self._guard_ok(key, mod_revision):
                return False
            self._publish([self._write(key, value, lease)])
            return True

    def txn_put_many(self, guard: Tuple[str, int], puts: Iterable[Tuple[str, Any, Optional[int]]]) -> bool:
        with self._lock:
            if not self._guard_ok(*guard):
                return False
            self._publish([self._write(k, v, lease) for k, v, lease in puts])
            return True

    def txn_delete_prefix_if(self, prefix: str, guard: Tuple[str, int]) -> bool:
        with self._lock:
            if not self._guard_ok(*guard):
                return False
            self._publish([self._remove(k) for k in sorted(self._kv) if k.startswith(prefix)])
            return True

    def txn(self, guards: Sequence[Guard], puts: Iterable[Tuple[str, Any, Optional[int]]] = (),
            delete_prefixes: Iterable[str] = (), deletes: Iterable[str] = ()) -> bool:
        with self._lock:
            if not all(self._holds(g) for g in guards):
                return False
            events = [self._remove(k) for p in delete_prefixes for k in sorted(self._kv) if k.startswith(p)]
            events += [self._remove(k) for k in deletes if k in self._kv]
            self._publish(events + [self._write(k, v, lease) for k, v, lease in puts])
            return True

    def _holds(self, g: Guard) -> bool:
        if g.prefix:
            return not any(k.startswith(g.key) for k in self._kv)
        return self._guard_ok(g.key, g.mod_revision)

    def snapshot(self, keys: Sequence[str], count_prefixes: Sequence[str] = ()) -> Snapshot:
        with self._lock:
            return Snapshot({k: self._kv.get(k) for k in keys},
                            {p: sum(1 for k in self._kv if k.startswith(p)) for p in count_prefixes}, self._rev)

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._kv:
                return False
            self._publish([self._remove(key)])
            return True

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            events = [self._remove(k) for k in sorted(self._kv) if k.startswith(prefix)]
            self._publish(events)
            return len(events)

    def delete_range(self, start: str, end: str) -> int:
        with self._lock:
            events = [self._remove(k) for k in sorted(self._kv) if start <= k < end]
            self._publish(events)
            return len(events)

    def grant_lease(self, ttl: int) -> int:
        with self._lock:
            lease = next(self._ids)
            self._leases[lease] = int(ttl)
            return lease

    def refresh_lease(self, lease_id: int) -> int:
        with self._lock:
            return self._leases.get(lease_id, 0)

    def lease_ttl(self, lease_id: int) -> Optional[Dict[str, int]]:
        with self._lock:
            ttl = self._leases.get(lease_id)
            return None if ttl is None else {"ttl": ttl, "granted_ttl": ttl}

    def revoke_lease(self, lease_id: int) -> None:
        self.expire(lease_id)

    def expire(self, lease_id: int) -> None:
        """The lease ends (revoked, or its node stopped refreshing): its keys are deleted."""
        with self._lock:
            self._leases.pop(lease_id, None)
            self._publish([self._remove(k) for k, kv in sorted(self._kv.items()) if kv.lease == lease_id])

    def watch_prefix(
        self, prefix: str, on_events: Callable[[List[WatchEvent]], None], on_error: Callable[[BaseException], None],
        start_revision: Optional[int] = None,
    ) -> Callable[[], None]:
        with self._lock:
            wid = next(self._ids)
            self._watches[wid] = (prefix, on_events)
            if start_revision is not None:
                missed = [ev for ev in self._history if ev.mod_revision >= start_revision and ev.key.startswith(prefix)]
                if missed:
                    self._events.put((wid, missed))

        def cancel() -> None:
            with self._lock:
                self._watches.pop(wid, None)

        return cancel

    def wait_for(self, key: str, predicate: Callable[[Optional[KeyValue]], bool], timeout: float) -> Optional[KeyValue]:
        deadline = time.monotonic() + timeout
        while True:
            kv = self.get(key)
            if predicate(kv):
                return kv
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.01)

    def ping(self) -> None:
        return None

    def close(self) -> None:
        self._events.put(None)


__all__ = ["FakeStore"]
