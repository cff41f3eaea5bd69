"""Read-only snapshots of jobs in etcd, for ``elasticrun status`` (no CLI, no printing).

:func:`job_status` reads one job's prefix in a single range read (plus one cheap
``LeaseTimeToLive`` per registered node) and returns a plain, JSON-ready ``dict`` with
stable keys; :func:`list_jobs` summarises every job under ``/elasticrun/``. The pure
builders (:func:`build_job_status`, :func:`summarise_jobs`) take the key/values
themselves, so they can be fed from a watch or a test.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

from elasticrun.errors import ElasticrunError, StoreError, StoreSetupError
from elasticrun.job import records
from elasticrun.job.keys import ROOT, JobKeys, job_of
from elasticrun.rendezvous.records import (
    Member,
    NodeInfo,
    RescaleEvent,
    WorkerStatus,
    event_record,
    node_record,
    topology_record,
)
from elasticrun.rendezvous.states import JobPhase, JobState, MemberStatus
from elasticrun.store.client import EtcdStore, KeyValue

EVENTS_SHOWN = 10  # newest rescale events in a status document

LeaseInfo = Callable[[int], Optional[Dict[str, int]]]


class JobNotFoundError(ElasticrunError):
    """No key of the requested job exists in etcd."""

    exit_code = 2


def _event_row(ev: RescaleEvent) -> Dict[str, Any]:
    return {
        "type": ev.type.value,
        "round": ev.round,
        "old_world_size": ev.old_world_size,
        "new_world_size": ev.new_world_size,
        "old_members": list(ev.old_members),
        "new_members": list(ev.new_members),
        "added": ev.added,
        "removed": ev.removed,
        "reason": ev.reason,
        "restart_count": ev.restart_count,
        "time": ev.time,
    }


def _records_under(data: Dict[str, KeyValue], prefix: str, check: Callable[[Any], Any]) -> Dict[str, Any]:
    """The records under ``prefix`` that ``check`` accepts, by the rest of their key (a node id); a
    malformed one is reported once and left out."""
    found: Dict[str, Any] = {}
    for key, kv in data.items():
        if key.startswith(prefix):
            value = records.read(kv, check)
            if value is not None:
                found[key[len(prefix):]] = value
    return found


def _node_row(info: NodeInfo, lease: int, lease_info: Optional[LeaseInfo]) -> Dict[str, Any]:
    ttl = lease_info(lease) if (lease_info is not None and lease) else None
    return {
        "node_id": info.node_id,
        "host": info.host,
        "addr": info.addr,
        "pid": info.pid,
        "nproc": info.nproc,
        "accelerators": list(info.accelerators),
        "status": info.status.value,
        "waiting_for": info.waiting_for,
        "registered": True,
        "registered_at": info.registered_at,
        "heartbeat_at": info.heartbeat_at,
        "lease_id": lease,
        "lease_ttl": None if ttl is None else ttl.get("ttl"),
        "lease_granted_ttl": None if ttl is None else ttl.get("granted_ttl"),
        # etcd resets a lease's TTL on every keep-alive: granted - left = seconds since the last one
        "lease_heartbeat_age": None if ttl is None else max(0, ttl["granted_ttl"] - ttl["ttl"]),
    }


def build_job_status(
    job: str,
    kvs: Iterable[KeyValue],
    revision: int = 0,
    lease_info: Optional[LeaseInfo] = None,
    events: int = EVENTS_SHOWN,
) -> Dict[str, Any]:
    """The status document of ``job`` from its keys (``kvs``: everything under its prefix).

    Stable top-level keys: job, exists, revision, time, config, nnodes, max_restarts, state,
    round, world_size, restart_count, master_addr, master_port, round_created_at, round_end,
    members, spares, events, goodput_nodes (each agent's goodput accounting by node id), expires_at
    (when an ended job's keys leave etcd; None while it runs or when they stay). A malformed record
    (:mod:`elasticrun.job.records`) is reported once and shown as absent.
    ``lease_info(lease_id)`` may return ``{"ttl", "granted_ttl"}``.
    """
    keys = JobKeys(job)
    data = {kv.key: kv for kv in kvs if kv.key.startswith(keys.prefix)}
    config = records.read(data.get(keys.config), records.config_record) or {}
    state = records.read(data.get(keys.state), records.state_record)
    topo = records.read(data.get(keys.topology), topology_record)
    infos = _records_under(data, keys.nodes, node_record)
    nodes = {n: _node_row(info, data[keys.node(n)].lease, lease_info) for n, info in infos.items()}
    progress = _records_under(data, keys.progress, records.progress_record)
    goodput = _records_under(data, keys.goodput, records.goodput_record)

    members: List[Dict[str, Any]] = []
    round_end: Dict[str, Any] = {"failed": None, "end": None, "done": []}
    if topo is not None:
        round_end["failed"] = records.read(data.get(keys.failed(topo.round)), records.failed_flag)
        round_end["end"] = records.read(data.get(keys.end(topo.round)), records.end_flag)
        dones, lefts = keys.dones(topo.round), keys.lefts(topo.round)
        round_end["done"] = sorted(k[len(dones):] for k in data if k.startswith(dones))
        left = {k[len(lefts):] for k in data if k.startswith(lefts)}
        for m in topo.members:
            node = nodes.get(m.node_id)
            same = node is not None and (not m.lease or node["lease_id"] == m.lease)
            failures = records.read(data.get(keys.failure(topo.round, m.node_id)), records.failure_rows)
            row: Dict[str, Any] = dict(node) if same and node is not None else _gone_row(m)
            if failures and row["status"] == WorkerStatus.ACTIVE:
                row["status"] = WorkerStatus.FAILED.value
            if row["status"] == MemberStatus.LOST:
                row["status"] = _gone_status(m.node_id, round_end["done"], left, state)
            row.update(
                group_rank=m.group_rank,
                rank_offset=m.rank_offset,
                ranks=list(m.ranks),
                nproc=m.nproc,
                failed_workers=failures or [],
                progress=progress.get(m.node_id),
            )
            members.append(row)
    member_keys = {(r["node_id"], r["lease_id"]) for r in members if r["registered"]}
    spares = []
    for node_id in sorted(nodes, key=lambda n: (nodes[n]["registered_at"] or 0, n)):
        row = nodes[node_id]
        if (node_id, row["lease_id"]) not in member_keys:
            spares.append(dict(row, progress=progress.get(node_id)))

    event_rows = []
    for key in sorted((k for k in data if k.startswith(keys.events)), reverse=True)[: max(0, events)]:
        ev = records.read(data[key], event_record)
        if ev is not None:
            event_rows.append(_event_row(ev))
    expiry = records.read(data.get(keys.expiry), records.expiry_record)

    max_restarts = config.get("max_restarts")
    return {
        "job": job,
        "exists": bool(data),
        "revision": revision,
        "time": time.time(),
        "config": config or None,
        "nnodes": config.get("nnodes"),
        "max_restarts": max_restarts,
        "state": state,
        "round": None if topo is None else topo.round,
        "world_size": 0 if topo is None else topo.world_size,
        "restart_count": 0 if topo is None else topo.restart_count,
        "master_addr": None if topo is None else topo.master_addr,
        "master_port": None if topo is None else topo.master_port,
        "round_created_at": None if topo is None else topo.created_at,
        "round_end": round_end,
        "members": members,
        "spares": spares,
        "events": event_rows,
        "goodput_nodes": goodput,
        "expires_at": None if expiry is None else float(expiry["time"]) + float(expiry["ttl"]),
    }


def _gone_row(m: Member) -> Dict[str, Any]:
    """A member whose node record is gone (or belongs to a newer incarnation)."""
    return {
        "node_id": m.node_id, "host": m.host, "addr": m.addr, "pid": None, "nproc": m.nproc, "accelerators": [],
        "status": MemberStatus.LOST.value, "waiting_for": None, "registered": False, "registered_at": None,
        "heartbeat_at": None, "lease_id": m.lease, "lease_ttl": None, "lease_granted_ttl": None,
        "lease_heartbeat_age": None,
    }


def _gone_status(node_id: str, done: List[str], left: Set[str], state: Optional[Dict[str, Any]]) -> str:
    """A member whose record is gone: Finished when its workers finished (or the job succeeded or failed
    with it), Left when it left on a signal (``rounds/<n>/left/<node>``), else Lost."""
    if node_id in done:
        return MemberStatus.FINISHED.value
    if node_id in left:
        return MemberStatus.LEFT.value
    if state is not None and state.get("state") in (JobState.SUCCEEDED, JobState.FAILED):
        return MemberStatus.FINISHED.value
    return MemberStatus.LOST.value


def job_phase(doc: Dict[str, Any]) -> str:
    """One word for a job (a :class:`JobPhase` value): succeeded/failed (terminal), forming,
    rescaling (the round is ending), running. A terminal state etcd spells otherwise is shown as is."""
    state = doc.get("state")
    if isinstance(state, dict) and state.get("state"):
        return str(state["state"])
    if doc.get("round") is None:
        return JobPhase.FORMING.value
    end = doc.get("round_end") or {}
    if end.get("failed") or end.get("end"):
        return JobPhase.RESCALING.value
    ending = (MemberStatus.LOST, WorkerStatus.RESCALING, WorkerStatus.FAILED)
    if any(m["status"] in ending for m in doc.get("members", [])):
        return JobPhase.RESCALING.value
    return JobPhase.RUNNING.value


def _lease_info(store: EtcdStore) -> LeaseInfo:
    def get(lease_id: int) -> Optional[Dict[str, int]]:
        try:
            return store.lease_ttl(lease_id)
        except ElasticrunError:
            return None

    return get


def job_status(
    store: EtcdStore, job: str, *, events: int = EVENTS_SHOWN, leases: bool = True
) -> Dict[str, Any]:
    """The status document of ``job`` (see :func:`build_job_status`); JobNotFoundError if it has no keys."""
    kvs, revision = store.get_prefix(JobKeys(job).prefix)
    if not kvs:
        try:
            known = [j["job"] for j in list_jobs(store)]
            hint = f"jobs there: {', '.join(known[:10])}" if known else "there are no jobs there"
        except ElasticrunError:  # a job's own etcd user may read its prefix only
            hint = "this etcd user may not list the other jobs"
        raise JobNotFoundError(
            f"no job {job!r} in etcd at {store.endpoints} ({hint}); check --rdzv-id and --rdzv-endpoint"
        )
    doc = build_job_status(job, kvs, revision, _lease_info(store) if leases else None, events)
    doc["phase"] = job_phase(doc)
    return doc


def summarise_jobs(kvs: Iterable[KeyValue]) -> List[Dict[str, Any]]:
    """One row per job found under ``/elasticrun/``: job, phase, round, world_size, nodes, restart_count."""
    by_job: Dict[str, List[KeyValue]] = {}
    for kv in kvs:
        job = job_of(kv.key)
        if job and not job.startswith("."):
            by_job.setdefault(job, []).append(kv)
    rows = []
    for job in sorted(by_job):
        doc = build_job_status(job, by_job[job], events=0)
        rows.append(
            {
                "job": job,
                "phase": job_phase(doc),
                "state": doc["state"],
                "round": doc["round"],
                "world_size": doc["world_size"],
                "members": len(doc["members"]),
                "nodes": len(doc["spares"]) + sum(1 for m in doc["members"] if m["registered"]),
                "restart_count": doc["restart_count"],
                "max_restarts": doc["max_restarts"],
                "nnodes": doc["nnodes"],
            }
        )
    return rows


def list_jobs(store: EtcdStore) -> List[Dict[str, Any]]:
    """Every job in this etcd (see :func:`summarise_jobs`)."""
    try:
        kvs, _ = store.get_prefix(ROOT)
    except StoreError as err:
        if "denied" not in str(err):
            raise
        raise StoreSetupError(f"{err}; a job's own etcd user may list nothing but its job: pass --rdzv-id") from None
    return summarise_jobs(kvs)


__all__ = [
    "EVENTS_SHOWN",
    "JobNotFoundError",
    "build_job_status",
    "job_phase",
    "job_status",
    "list_jobs",
    "summarise_jobs",
]
