"""Plain values of the etcd client: keys as read, watch events, endpoint lists."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from elasticrun.errors import StoreSetupError


@dataclass(frozen=True)
class KeyValue:
    """One key as read from etcd."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix; ``value`` is empty for deletes."""

    key: str
    value: bytes
    deleted: bool
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Member:
    """One member of an etcd cluster as etcd lists it (:mod:`elasticrun.store.members`). A member added but
    not started yet has no name and no client URL."""

    member_id: int
    name: str
    peer_urls: Tuple[str, ...]
    client_urls: Tuple[str, ...]
    learner: bool

    @property
    def started(self) -> bool:
        """etcd names a member once it has started and published itself."""
        return bool(self.name)

    @property
    def voter(self) -> bool:
        return not self.learner


@dataclass(frozen=True)
class Guard:
    """One condition of a transaction (:meth:`EtcdStore.txn`): ``key``'s mod revision equals
    ``mod_revision`` (0: the key is absent); with ``prefix``, no key starts with ``key`` at all."""

    key: str
    mod_revision: int = 0
    prefix: bool = False

    @classmethod
    def absent(cls, key: str) -> Guard:
        return cls(key, 0)

    @classmethod
    def unchanged(cls, kv: Optional[KeyValue], key: str) -> Guard:
        """``key`` is still as read: ``kv`` (its revision), or absent when ``kv`` is None."""
        return cls(key, 0 if kv is None else kv.mod_revision)

    @classmethod
    def empty(cls, prefix: str) -> Guard:
        return cls(prefix, 0, prefix=True)


@dataclass(frozen=True)
class Snapshot:
    """Several keys and prefix counts read at one revision (:meth:`EtcdStore.snapshot`)."""

    kvs: Dict[str, Optional[KeyValue]]
    counts: Dict[str, int]
    revision: int


def parse_endpoints(endpoints: str) -> List[Tuple[str, int]]:
    """``"a:2379,http://b:2379"`` → ``[("a", 2379), ("b", 2379)]``; raises StoreError when malformed."""
    result = []
    for raw in endpoints.split(","):
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        item = item.rstrip("/")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreSetupError(f"bad etcd endpoint {raw.strip()!r}: expected host:port, e.g. 127.0.0.1:2379")
        result.append((host, int(port)))
    if not result:
        raise StoreSetupError("no etcd endpoint given: pass --rdzv-endpoint host:port[,host:port...]")
    return result


def text_of(b: bytes | str) -> str:
    """etcd bytes (a key) as text."""
    return b.decode() if isinstance(b, (bytes, bytearray)) else b


def kv_from_pb(kv: Any) -> KeyValue:
    """A :class:`KeyValue` from the etcd library's key-value message."""
    return KeyValue(
        key=text_of(kv.key),
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
        lease=int(kv.lease),
    )


def dumps(value: Any) -> str:
    """``value`` as the compact, key-sorted JSON every elasticrun record is stored as."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


__all__ = ["Guard", "KeyValue", "Snapshot", "WatchEvent", "dumps", "kv_from_pb", "parse_endpoints", "text_of"]
