"""Read-only snapshots of jobs in etcd, for ``elasticrun status`` (no CLI, no printing).

:func:`job_status` reads one job's prefix in a single range read (plus one cheap
``LeaseTimeToLive`` per registered node, :func:`read_leases`) and returns a plain, JSON-ready
``dict`` with stable keys; :func:`list_jobs` summarises every job under ``/elasticrun/``. The
pure builders (:func:`build_job_status`, :func:`summarise_jobs`) take the key/values (and the
lease TTLs) themselves, so they can be fed from a watch or a test.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set

from elasticrun.errors import ElasticrunError, StoreError, StoreSetupError
from elasticrun.job import records
from elasticrun.job.keys import ROOT, JobKeys, job_of
from elasticrun.rendezvous.records import (
    Member,
    NodeInfo,
    RescaleEvent,
    Topology,
    WorkerStatus,
    event_record,
    node_record,
    topology_record,
)
from elasticrun.rendezvous.states import JobPhase, JobState, MemberStatus
from elasticrun.store.client import EtcdStore, KeyValue

EVENTS_SHOWN = 10  # newest rescale events in a status document

LeaseTTL = Dict[str, int]  # {"ttl": seconds left, "granted_ttl": seconds}, as EtcdStore.lease_ttl reads it


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
        "recovers": ev.recovers,
        "kept": list(ev.kept),
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


def _node_row(info: NodeInfo, lease: int, leases: Mapping[int, LeaseTTL]) -> Dict[str, Any]:
    ttl = leases.get(lease) if lease else None
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


def _lost_row(m: Member) -> Dict[str, Any]:
    """The row of a member whose node record is gone (or belongs to a newer incarnation)."""
    return {
        "node_id": m.node_id,
        "host": m.host,
        "addr": m.addr,
        "pid": None,
        "nproc": m.nproc,
        "accelerators": [],
        "status": MemberStatus.LOST.value,
        "waiting_for": None,
        "registered": False,
        "registered_at": None,
        "heartbeat_at": None,
        "lease_id": m.lease,
        "lease_ttl": None,
        "lease_granted_ttl": None,
        "lease_heartbeat_age": None,
    }


def _node_rows(data: Dict[str, KeyValue], keys: JobKeys, leases: Mapping[int, LeaseTTL]) -> Dict[str, Dict[str, Any]]:
    """A row per well-formed node record, by node id (a malformed one is reported once and left out)."""
    infos: Dict[str, NodeInfo] = _records_under(data, keys.nodes, node_record)
    return {n: _node_row(info, data[keys.node(n)].lease, leases) for n, info in infos.items()}


def _round_end(data: Dict[str, KeyValue], keys: JobKeys, topo: Optional[Topology]) -> Dict[str, Any]:
    """How the current round is ending: the failure that ends it, a requested end, the nodes done."""
    if topo is None:
        return {"failed": None, "end": None, "done": []}
    dones = keys.dones(topo.round)
    return {
        "failed": records.read(data.get(keys.failed(topo.round)), records.failed_flag),
        "end": records.read(data.get(keys.end(topo.round)), records.end_flag),
        "done": sorted(k[len(dones):] for k in data if k.startswith(dones)),
    }


def _member_row(m: Member, node: Optional[Dict[str, Any]], failures: Any, progress: Optional[Dict[str, Any]],
                gone_status: str) -> Dict[str, Any]:
    """A member of the round: its node's row when the same incarnation is registered, else
    ``gone_status`` (Lost, Left or Finished); Failed when an Active node reported failed workers."""
    same = node is not None and (not m.lease or node["lease_id"] == m.lease)
    row: Dict[str, Any] = dict(node) if same and node is not None else _lost_row(m)
    if failures and row["status"] == WorkerStatus.ACTIVE:
        row["status"] = WorkerStatus.FAILED.value
    if row["status"] == MemberStatus.LOST:
        row["status"] = gone_status
    row.update(
        group_rank=m.group_rank,
        rank_offset=m.rank_offset,
        ranks=list(m.ranks),
        nproc=m.nproc,
        failed_workers=failures or [],
        progress=progress,
    )
    return row


def _members(data: Dict[str, KeyValue], keys: JobKeys, topo: Optional[Topology], nodes: Dict[str, Dict[str, Any]],
             progress: Dict[str, Dict[str, Any]], done: List[str], state: Any) -> List[Dict[str, Any]]:
    if topo is None:
        return []
    lefts = keys.lefts(topo.round)
    left = {k[len(lefts):] for k in data if k.startswith(lefts)}
    return [
        _member_row(m, nodes.get(m.node_id),
                    records.read(data.get(keys.failure(topo.round, m.node_id)), records.failure_rows),
                    progress.get(m.node_id), _gone_status(m.node_id, done, left, state))
        for m in topo.members
    ]


def _spares(nodes: Dict[str, Dict[str, Any]], members: List[Dict[str, Any]],
            progress: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The registered nodes that are not (this incarnation of) a member, oldest registration first."""
    member_keys = {(r["node_id"], r["lease_id"]) for r in members if r["registered"]}
    return [
        dict(nodes[node_id], progress=progress.get(node_id))
        for node_id in sorted(nodes, key=lambda n: (nodes[n]["registered_at"] or 0, n))
        if (node_id, nodes[node_id]["lease_id"]) not in member_keys
    ]


def _event_rows(data: Dict[str, KeyValue], keys: JobKeys, events: int) -> List[Dict[str, Any]]:
    """The newest ``events`` well-formed rescale events, newest first."""
    rows = []
    for key in sorted((k for k in data if k.startswith(keys.events)), reverse=True)[: max(0, events)]:
        ev = records.read(data[key], event_record)
        if ev is not None:
            rows.append(_event_row(ev))
    return rows


def _health(data: Dict[str, KeyValue], keys: JobKeys, topo: Optional[Topology],
            members: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The leader's straggler scores of the current round (``stragglers``, None when none), each member's
    ``straggler`` flag and ``straggler_ratio`` (set on ``members``), and the nodes kept out (``excluded``)."""
    scores = records.read(data.get(keys.stragglers), records.straggler_record)
    if scores is None or topo is None or scores["round"] != topo.round:
        scores = None
    slow = (scores or {}).get("nodes") or {}
    for m in members:
        m["straggler"] = m["node_id"] in slow
        m["straggler_ratio"] = slow.get(m["node_id"])
    excluded = [dict(rec, node_id=node) for node, rec in
                sorted(_records_under(data, keys.excluded, records.excluded_record).items())]
    return {"stragglers": scores, "excluded": excluded}


def _round_fields(topo: Optional[Topology]) -> Dict[str, Any]:
    """The document's fields of the current round (empty values before the first round)."""
    if topo is None:
        return {"round": None, "world_size": 0, "restart_count": 0, "master_addr": None, "master_port": None,
                "round_created_at": None}
    return {"round": topo.round, "world_size": topo.world_size, "restart_count": topo.restart_count,
            "master_addr": topo.master_addr, "master_port": topo.master_port, "round_created_at": topo.created_at}


def build_job_status(
    job: str,
    kvs: Iterable[KeyValue],
    revision: int = 0,
    leases: Optional[Mapping[int, LeaseTTL]] = None,
    events: int = EVENTS_SHOWN,
    now: Optional[float] = None,
) -> Dict[str, Any]:
    """The status document of ``job`` from its keys (``kvs``: everything under its prefix); no I/O.

    Stable top-level keys: job, exists, revision, time, config, nnodes, max_restarts, state,
    round, world_size, restart_count, master_addr, master_port, round_created_at, round_end,
    members (each with ``straggler``/``straggler_ratio``), spares, events, goodput_nodes (each agent's
    goodput accounting by node id), stragglers (the leader's scores of this round, or None), excluded
    (nodes kept out by a failed node check or a drain: node_id, reason, why, time), expires_at
    (when an ended job's keys leave etcd; None while it runs or when they stay). A malformed record
    (:mod:`elasticrun.job.records`) is reported once and shown as absent. ``leases`` maps a node
    record's lease id to its ``{"ttl", "granted_ttl"}`` (see
    :func:`read_leases`); ``now`` is the document's time (default: the current time).
    """
    keys = JobKeys(job)
    data = {kv.key: kv for kv in kvs if kv.key.startswith(keys.prefix)}
    config = records.read(data.get(keys.config), records.config_record) or {}
    state = records.read(data.get(keys.state), records.state_record)
    topo: Optional[Topology] = records.read(data.get(keys.topology), topology_record)
    nodes = _node_rows(data, keys, leases or {})
    progress = _records_under(data, keys.progress, records.progress_record)
    expiry = records.read(data.get(keys.expiry), records.expiry_record)
    round_end = _round_end(data, keys, topo)
    members = _members(data, keys, topo, nodes, progress, round_end["done"], state)
    return {
        "job": job,
        "exists": bool(data),
        "revision": revision,
        "time": time.time() if now is None else now,
        "config": config or None,
        "nnodes": config.get("nnodes"),
        "max_restarts": config.get("max_restarts"),
        "state": state,
        **_round_fields(topo),
        "round_end": round_end,
        "members": members,
        "spares": _spares(nodes, members, progress),
        "events": _event_rows(data, keys, events),
        "goodput_nodes": _records_under(data, keys.goodput, records.goodput_record),
        **_health(data, keys, topo, members),
        "expires_at": None if expiry is None else float(expiry["time"]) + float(expiry["ttl"]),
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


def read_leases(store: EtcdStore, job: str, kvs: Iterable[KeyValue]) -> Dict[int, LeaseTTL]:
    """The TTLs of the leases the job's node records are attached to (one cheap ``LeaseTimeToLive``
    each); a lease gone, or one this etcd user may not read, is left out."""
    nodes = JobKeys(job).nodes
    found: Dict[int, LeaseTTL] = {}
    for lease in sorted({kv.lease for kv in kvs if kv.lease and kv.key.startswith(nodes)}):
        try:
            ttl = store.lease_ttl(lease)
        except ElasticrunError:
            continue
        if ttl is not None:
            found[lease] = ttl
    return found


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
    doc = build_job_status(job, kvs, revision, read_leases(store, job, kvs) if leases else None, events, time.time())
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
    "read_leases",
    "summarise_jobs",
]
