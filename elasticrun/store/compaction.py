"""How much history an etcd that elasticrun starts keeps, and how to read its size.

Every etcd elasticrun starts (``--standalone``, the one hosted for ``c10d``/``static``,
``elasticrun etcd``) runs with etcd's auto-compaction on. A retention is either a time
(``30s``, ``5m``, ``1h``: etcd's ``periodic`` mode) or a number of revisions (``10000rev``:
``revision`` mode). The default, :data:`DEFAULT_RETENTION`, is 5 minutes: etcd then compacts
every 5 minutes to the revision of 5 minutes before, so at most 10 minutes of writes are kept,
whatever the number of nodes (``revision`` mode checks only every 5 minutes, so it keeps
``N`` revisions plus 5 minutes of writes: never fewer). docs/reliability.md derives the
bound on the database file from it.

Compaction frees pages inside etcd's database file; the file reuses them and stops growing,
but does not shrink (``etcdctl defrag`` gives the space back). The quota
(``--quota-backend-bytes``, etcd's default 2 GiB) is the last guard: past it etcd raises the
``NOSPACE`` alarm and refuses writes (:mod:`elasticrun.store.explain` says what to run).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from elasticrun.errors import ConfigError
from elasticrun.job import env as names

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore

ENV_RETENTION = names.ETCD_COMPACTION_RETENTION
DEFAULT_RETENTION = "5m"
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_REVS = re.compile(r"^(\d+)\s*rev(?:s|isions?)?$")


@dataclass(frozen=True)
class Retention:
    """etcd's ``--auto-compaction-mode`` and ``--auto-compaction-retention``."""

    mode: str  # "periodic" or "revision"
    value: str  # "5m" (periodic) or "10000" (revision)

    def args(self) -> List[str]:
        return [f"--auto-compaction-mode={self.mode}", f"--auto-compaction-retention={self.value}"]

    def __str__(self) -> str:
        return self.value if self.mode == "periodic" else f"{self.value} revisions"


def parse_retention(text: str, origin: str = "--compaction-retention") -> Retention:
    """``"5m"`` → periodic 5m, ``"10000rev"`` → revision 10000; ConfigError (one line) otherwise."""
    raw = text.strip().lower()
    m = _TIME.match(raw)
    if m and float(m.group(1)) > 0:
        return Retention("periodic", raw)
    m = _REVS.match(raw)
    if m and int(m.group(1)) > 0:
        return Retention("revision", m.group(1))
    raise ConfigError(
        f"{origin} {text!r}: expected a time such as 30s, 5m or 1h (history kept that long) or a number of "
        "revisions such as 10000rev"
    )


def retention_from_env(explicit: Optional[str] = None) -> Retention:
    """``explicit``, else ``$ELASTICRUN_ETCD_COMPACTION_RETENTION``, else :data:`DEFAULT_RETENTION`."""
    if explicit:
        return parse_retention(explicit)
    from_env = os.environ.get(ENV_RETENTION)
    if from_env:
        return parse_retention(from_env, ENV_RETENTION)
    return parse_retention(DEFAULT_RETENTION)


def db_status(store: EtcdStore) -> Dict[str, int]:
    """The answering member's database: ``db_size`` (bytes of its file), ``revision`` (the newest)
    and ``compact_revision`` (history before it is compacted away; -1: never compacted).
    Hashes the whole key space (etcd's HashKV): for tests and maintenance, not for hot paths."""
    from elasticrun.store.client import pyetcd  # the one module that imports the etcd library

    etcdrpc = pyetcd.etcdrpc
    def op(c: Any) -> Dict[str, int]:
        meta: Dict[str, Any] = dict(credentials=c.call_credentials, metadata=c.metadata)
        st = c.maintenancestub.Status(etcdrpc.StatusRequest(), store.timeout, **meta)
        kv = c.maintenancestub.HashKV(etcdrpc.HashKVRequest(revision=0), store.timeout, **meta)
        return {"db_size": int(st.dbSize), "revision": int(st.header.revision),
                "compact_revision": int(kv.compact_revision)}

    return store._call("status", op)  # noqa: SLF001 - the store's retries, for a maintenance call


__all__ = ["db_status", "DEFAULT_RETENTION", "ENV_RETENTION", "Retention", "parse_retention", "retention_from_env"]
