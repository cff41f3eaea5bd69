"""How much history an etcd that elasticrun starts keeps.

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
from typing import List, Optional

from elasticrun.errors import ConfigError

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


def retention_from_env(variable: str, explicit: Optional[str] = None) -> Retention:
    """``explicit``, else the environment variable ``variable``, else :data:`DEFAULT_RETENTION`."""
    if explicit:
        return parse_retention(explicit)
    from_env = os.environ.get(variable)
    if from_env:
        return parse_retention(from_env, variable)
    return parse_retention(DEFAULT_RETENTION)


__all__ = ["DEFAULT_RETENTION", "Retention", "parse_retention", "retention_from_env"]
