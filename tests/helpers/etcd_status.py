"""The size and history of an etcd member's database, for the compaction tests."""

from __future__ import annotations

from typing import Any, Dict

from elasticrun.store.client import EtcdStore, pyetcd


def db_status(store: EtcdStore) -> Dict[str, int]:
    """The answering member's database: ``db_size`` (bytes of its file), ``revision`` (the newest)
    and ``compact_revision`` (history before it is compacted away; -1: never compacted).
    Hashes the whole key space (etcd's HashKV): slow on a large database."""
    etcdrpc = pyetcd.etcdrpc

    def op(c: Any) -> Dict[str, int]:
        meta: Dict[str, Any] = dict(credentials=c.call_credentials, metadata=c.metadata)
        st = c.maintenancestub.Status(etcdrpc.StatusRequest(), store.timeout, **meta)
        kv = c.maintenancestub.HashKV(etcdrpc.HashKVRequest(revision=0), store.timeout, **meta)
        return {"db_size": int(st.dbSize), "revision": int(st.header.revision),
                "compact_revision": int(kv.compact_revision)}

    return store._call("status", op)  # noqa: SLF001 - the store's retries, for a maintenance call


__all__ = ["db_status"]
