"""A local mirror of one job's etcd keys, kept current by a watch (no polling).

The view reads the job prefix once, then applies watch events. If the watch dies
(etcd restarted, revision compacted) it re-reads and re-watches in the background with
backoff. Callers block in :meth:`wait_change` and then inspect the snapshot helpers.

Node records are parsed once per change (not per look) and the topology once per
revision, so a wake-up costs O(nodes) dict work, not O(nodes) JSON parses. Keys under
``progress/`` (frequent worker reports the protocol never reads) are neither mirrored
nor wake anyone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from elasticrun.errors import StoreError
from elasticrun.models import NodeInfo, Topology
from elasticrun.rendezvous.keys import JobKeys
from elasticrun.store.client import EtcdStore, KeyValue, WatchEvent

log = logging.getLogger(__name__)


class JobView:
    """Mirror of ``/elasticrun/<job>/`` with change notification."""

    def __init__(self, store: EtcdStore, keys: JobKeys) -> None:
        self.store = store
        self.keys = keys
        self._data: Dict[str, KeyValue] = {}
        self._nodes: Dict[str, Tuple[NodeInfo, int]] = {}  # parsed nodes/*: node id -> (info, lease)
        self._topo: Tuple[Optional[Topology], int] = (None, 0)  # parsed topology and its mod revision
        self._ignored = (keys.progress,)
        self._cond = threading.Condition()
        self._version = 0
        self._closed = False
        self._cancel: Optional[Callable[[], None]] = None
        self._healthy = False
        self._sync()

    # -- keeping in sync ----------------------------------------------------------------

    def _sync(self) -> None:
        kvs, revision = self.store.get_prefix(self.keys.prefix)
        with self._cond:
            self._data = {}
            self._nodes = {}
            for kv in kvs:
                if not kv.key.startswith(self._ignored):
                    self._put(kv)
            self._healthy = True
            self._version += 1
            self._cond.notify_all()
        self._cancel = self.store.watch_prefix(
            self.keys.prefix, self._on_events, self._on_error, start_revision=revision + 1
        )

    def _put(self, kv: KeyValue) -> None:
        """Mirror one key (lock held); node records are parsed here, once."""
        self._data[kv.key] = kv
        if kv.key.startswith(self.keys.nodes):
            node_id = kv.key[len(self.keys.nodes):]
            try:
                self._nodes[node_id] = (NodeInfo.from_dict(json.loads(kv.value)), kv.lease)
            except (ValueError, TypeError, KeyError):
                self._nodes.pop(node_id, None)
                log.warning("ignoring malformed node record %s", kv.key)

    def _on_events(self, events: List[WatchEvent]) -> None:
        events = [ev for ev in events if not ev.key.startswith(self._ignored)]
        if not events:
            return
        with self._cond:
            for ev in events:
                if ev.deleted:
                    self._data.pop(ev.key, None)
                    if ev.key.startswith(self.keys.nodes):
                        self._nodes.pop(ev.key[len(self.keys.nodes):], None)
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
            self._version += 1
            self._cond.notify_all()

    def _on_error(self, err: BaseException) -> None:
        with self._cond:
            if self._closed:
                return
            self._healthy = False
            self._version += 1
            self._cond.notify_all()
        threading.Thread(target=self._resync_loop, name="view-resync", daemon=True).start()

    def _resync_loop(self) -> None:
        delay = 0.1
        while not self._closed:
            try:
                self._sync()
                log.info("watch on %s re-established", self.keys.prefix)
                return
            except StoreError as err:
                log.debug("resync failed: %s", err)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._cancel is not None:
            self._cancel()

    # -- waiting --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def healthy(self) -> bool:
        return self._healthy

    def wait_change(self, since: int, timeout: float) -> int:
        """Block until the view changes after version ``since`` (or ``timeout``); return the version."""
        with self._cond:
            if self._version == since and not self._closed:
                self._cond.wait(timeout)
            return self._version

    def poke(self) -> None:
        """Wake up waiters (e.g. a local event such as a worker exit)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # -- snapshot helpers -----------------------------------------------------------------

    def get(self, key: str) -> Optional[KeyValue]:
        with self._cond:
            return self._data.get(key)

    def get_json(self, key: str) -> Any:
        kv = self.get(key)
        return None if kv is None else json.loads(kv.value)

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
        if cached is not None and rev == kv.mod_revision:
            return cached, rev
        topo = Topology.from_dict(json.loads(kv.value))  # frozen: safe to share between callers
        self._topo = (topo, kv.mod_revision)
        return topo, kv.mod_revision

    def state(self) -> Optional[Dict[str, Any]]:
        """The job's terminal state record, if it has ended."""
        return self.get_json(self.keys.state)
