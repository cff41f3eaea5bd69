"""build_job_status: a job's records -> its status document, without etcd (records as KeyValues)."""

from __future__ import annotations

import json
from typing import Any, List

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.jobstatus import build_job_status, job_phase, summarise_jobs
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleEvent, RescaleType, Topology, WorkerStatus
from elasticrun.store.types import KeyValue

JOB = "j1"
K = JobKeys(JOB)


def kv(key: str, value: Any, lease: int = 0) -> KeyValue:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KeyValue(key, raw, 1, 1, lease)


def node(node_id: str, lease: int, registered_at: float = 100.0, status: WorkerStatus = WorkerStatus.ACTIVE,
         waiting_for: int = -1) -> KeyValue:
    info = NodeInfo(node_id, f"host-{node_id}", f"10.0.0.{len(node_id)}", 2, 4242, status=status,
                    waiting_for=waiting_for, registered_at=registered_at, heartbeat_at=registered_at + 1)
    return kv(K.node(node_id), info.to_dict(), lease)


def topology(round_: int, members: List[str], leases: List[int]) -> KeyValue:
    ms = tuple(Member(n, f"host-{n}", "addr", 2, i, 2 * i, lease) for i, (n, lease) in enumerate(zip(members, leases)))
    return kv(K.topology, Topology(round_, ms, "10.0.0.1", 29500, restart_count=1, created_at=50.0).to_dict())


def test_no_keys_is_an_empty_document_at_the_given_time():
    doc = build_job_status(JOB, [], 7, None, now=123.0)
    assert doc["exists"] is False and doc["time"] == 123.0 and doc["revision"] == 7
    assert doc["round"] is None and doc["world_size"] == 0 and doc["members"] == [] and doc["spares"] == []
    assert doc["round_end"] == {"failed": None, "end": None, "done": []}
    assert job_phase(doc) == "forming"


def test_members_carry_their_node_row_ranks_progress_and_lease_age():
    kvs = [
        kv(K.config, {"nnodes": "2:4", "max_restarts": 3}),
        topology(4, ["a", "b"], [11, 12]),
        node("a", 11), node("b", 12),
        kv(K.progress_of("a"), {"step": 9}),
    ]
    doc = build_job_status(JOB, kvs, 1, {11: {"ttl": 7, "granted_ttl": 10}}, now=0.0)
    a, b = doc["members"]
    assert (doc["round"], doc["world_size"], doc["restart_count"], doc["nnodes"], doc["max_restarts"]) == (
        4, 4, 1, "2:4", 3)
    assert a["status"] == "Active" and a["ranks"] == [0, 1] and a["progress"] == {"step": 9}
    assert (a["lease_ttl"], a["lease_granted_ttl"], a["lease_heartbeat_age"]) == (7, 10, 3)
    assert b["ranks"] == [2, 3] and b["lease_ttl"] is None and b["progress"] is None
    assert doc["spares"] == [] and job_phase(doc) == "running"


def test_a_member_whose_record_is_gone_or_reincarnated_is_lost_and_the_new_incarnation_a_spare():
    kvs = [topology(2, ["a", "b"], [11, 12]), node("a", 11), node("b", 99)]  # b re-registered on a new lease
    doc = build_job_status(JOB, kvs, now=0.0)
    a, b = doc["members"]
    assert a["status"] == "Active" and a["registered"]
    assert b["status"] == "Lost" and not b["registered"] and b["lease_id"] == 12 and b["pid"] is None
    assert [(s["node_id"], s["lease_id"]) for s in doc["spares"]] == [("b", 99)]
    assert job_phase(doc) == "rescaling"


def test_a_lost_member_that_is_done_or_in_an_ended_job_is_finished():
    done = build_job_status(JOB, [topology(3, ["a"], [11]), kv(K.done(3, "a"), {})], now=0.0)
    assert done["members"][0]["status"] == "Finished" and done["round_end"]["done"] == ["a"]
    ended = build_job_status(JOB, [topology(3, ["a"], [11]), kv(K.state, {"state": "succeeded"})], now=0.0)
    assert ended["members"][0]["status"] == "Finished"
    lost = build_job_status(JOB, [topology(3, ["a"], [11]), kv(K.state, {"state": "running"})], now=0.0)
    assert lost["members"][0]["status"] == "Lost"


def test_failed_workers_turn_an_active_member_failed_and_the_round_end_is_read():
    kvs = [topology(5, ["a"], [11]), node("a", 11), kv(K.failure(5, "a"), [{"rank": 1, "exitcode": 3}]),
           kv(K.failed(5), {"node": "a", "rank": 1})]
    doc = build_job_status(JOB, kvs, now=0.0)
    m = doc["members"][0]
    assert m["status"] == "Failed" and m["failed_workers"] == [{"rank": 1, "exitcode": 3}]
    assert doc["round_end"]["failed"] == {"node": "a", "rank": 1} and job_phase(doc) == "rescaling"


def test_spares_oldest_first_and_malformed_records_left_out():
    kvs = [node("late", 1, registered_at=300.0, status=WorkerStatus.JOINING, waiting_for=2),
           node("early", 2, registered_at=200.0, status=WorkerStatus.JOINING),
           kv(K.node("junk"), b"{not json"), kv(K.node("list"), [1, 2]), kv(K.node("bad"), {"node_id": "x"}),
           kv(K.topology, {"round": "x"}), kv(K.event(1), {"type": "nonsense"})]
    doc = build_job_status(JOB, kvs, now=0.0)
    assert [s["node_id"] for s in doc["spares"]] == ["early", "late"]
    assert doc["spares"][1]["waiting_for"] == 2
    assert doc["round"] is None and doc["events"] == []


def test_events_newest_first_and_at_most_the_asked_number():
    def event(n: int) -> KeyValue:
        return kv(K.event(n), RescaleEvent(RescaleType.SCALE_UP, n, ["a"], ["a", "b"], 2, 4, "joined",
                                           time=float(n)).to_dict())

    doc = build_job_status(JOB, [event(n) for n in range(1, 6)], events=3, now=0.0)
    assert [e["round"] for e in doc["events"]] == [5, 4, 3]
    assert doc["events"][0]["added"] == ["b"] and doc["events"][0]["removed"] == []
    assert build_job_status(JOB, [event(1)], events=0, now=0.0)["events"] == []


def test_keys_of_another_job_are_ignored_and_summaries_count_registered_nodes():
    other = JobKeys("j2")
    kvs = [topology(1, ["a", "b"], [11, 12]), node("a", 11), node("c", 13),
           kv(other.topology, Topology(0, (), "h", 1).to_dict())]
    doc = build_job_status(JOB, kvs, now=0.0)
    assert [m["node_id"] for m in doc["members"]] == ["a", "b"] and [s["node_id"] for s in doc["spares"]] == ["c"]
    rows = {r["job"]: r for r in summarise_jobs(kvs)}
    assert rows["j1"]["members"] == 2 and rows["j1"]["nodes"] == 2  # a (member) and c (spare); b is lost
    assert rows["j2"]["round"] == 0 and rows["j2"]["nodes"] == 0
