"""A worker's own, best-effort connection to the job's etcd.

Training must never stall or crash because etcd is slow or gone, so everything that
talks to etcd from a worker runs on a background thread through an :class:`EtcdLink`:
it connects lazily with short timeouts, logs *one* warning when etcd is unreachable
(and one line when it is back), and drops the client after an error so the next call
reconnects. Each process makes its own client (gRPC channels must not cross ``fork``).
It connects with the job's :class:`~elasticrun.store.settings.EtcdSettings` (TLS, user and
password from the agent's settings file), like every other connection of the job.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.job import settings as job_settings
from elasticrun.job.keys import JobKeys
from elasticrun.store.settings import EtcdSettings

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore

log = logging.getLogger(__name__)


class EtcdLink:
    """Lazily connected :class:`~elasticrun.store.client.EtcdStore` for one purpose (``what``).

    ``settings`` default to the agent's settings file (``ELASTICRUN_ETCD_SETTINGS_FILE``);
    ``endpoint`` (when given) overrides their endpoints.
    """

    def __init__(
        self, endpoint: str, job_id: str, what: str, *, timeout: float = 2.0,
        settings: Optional[EtcdSettings] = None,
    ) -> None:
        self.endpoint = endpoint
        self.job_id = job_id
        self.what = what
        self.timeout = timeout
        self.keys = JobKeys(job_id)
        self.prefix = self.keys.prefix
        self._settings = settings
        self._store: Optional[EtcdStore] = None
        self._warned = False
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint and self.job_id)

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def settings(self) -> EtcdSettings:
        """How this link connects (read from the agent's settings file on first use)."""
        if self._settings is None:
            self._settings = job_settings.from_env(endpoints=self.endpoint) or EtcdSettings(self.endpoint)
        return self._settings

    def store(self) -> Optional[EtcdStore]:
        """The client, connecting if needed; None (after one warning) when etcd is unreachable."""
        if not self.enabled:
            return None
        with self._lock:
            if self._store is not None:
                return self._store
            try:
                self._store = self.settings().connect(self.keys.ping, timeout=self.timeout, retry_timeout=self.timeout)
            except (ElasticrunError, ImportError, OSError) as err:
                self._warn(err)
                return None
            if self._warned:
                log.warning("elasticrun %s: etcd at %s reachable again", self.what, self.endpoint)
                self._warned = False
            return self._store

    def failed(self, err: BaseException) -> None:
        """Report an error from a call on :meth:`store`'s client; the next call reconnects."""
        self._warn(err)
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _warn(self, err: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("elasticrun %s disabled while etcd is unreachable (%s); training goes on", self.what, err)

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()


__all__ = ["EtcdLink"]
