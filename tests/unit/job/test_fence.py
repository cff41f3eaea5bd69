"""The commit fence's rule (elasticrun.job.fence): who is fenced, and what the round record says,
including a survivor whose in-place re-form is pending."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import pytest

from elasticrun.job import env as names
from elasticrun.job.fence import fence_identity, fence_verdict, fenced_round, needs_node_lease, refusal
from elasticrun.job.keys import JobKeys

KEY = JobKeys("j").fence


def test_the_current_round_may_commit():
    assert refusal(3, KEY, b'{"round": 3, "members": []}') is None


@pytest.mark.parametrize("value, words", [
    (b'{"round": 4}', "belongs to round 3, which is no longer current: round 4 does not include this node"),
    (None, "belongs to round 3, which is no longer current: the job has no current round"),  # not confirmed
    (b'{"round": "4"}', f"the round record at {KEY} is malformed"),
    (b"{trunc", f"the round record at {KEY} is malformed"),
    (b"[1, 2]", f"the round record at {KEY} is malformed"),
])
def test_any_other_record_refuses_the_commit(value, words):
    why = refusal(3, KEY, value)
    assert why is not None and words in why and why.endswith("not committing"), why


def test_only_a_worker_of_a_job_with_etcd_is_fenced():
    worker = {names.ROUND: "2", names.RDZV_ID: "j", names.RDZV_ENDPOINT: "127.0.0.1:2379"}
    assert fenced_round(worker) == 2 and fence_identity(worker) == ("j", 2)
    for missing in worker:
        env = {k: v for k, v in worker.items() if k != missing}
        assert fenced_round(env) is None and fence_identity(env) is None, missing


def raw(record: dict) -> bytes:
    return json.dumps(record).encode()


def topology(round_: int, members: Sequence[str] = ("A", "B", "C"), inplace: Sequence[str] = (),
             leases: Optional[dict] = None) -> dict:
    leases = leases or {}
    record = {"round": round_,
              "members": [{"node_id": n, "lease": leases.get(n, 10 + i)} for i, n in enumerate(members)]}
    if inplace:
        record["inplace"] = list(inplace)
    return record


def test_the_current_round_commits() -> None:
    assert fence_verdict(3, "A", topology(3), None) is None


def test_a_survivor_whose_inplace_reform_is_pending_commits() -> None:
    """Round 1 formed with A, B re-forming in place; A's workers still train in round 0: the job."""
    topo = topology(1, inplace=("A", "B"))
    assert needs_node_lease(0, "A", raw(topo))
    assert fence_verdict(0, "A", topo, node_lease=10) is None


def test_a_survivor_whose_node_lost_its_lease_is_refused() -> None:
    topo = topology(1, inplace=("A", "B"))
    assert fence_verdict(0, "A", topo, node_lease=None) == "this node lost the lease round 1 names it with"
    assert fence_verdict(0, "A", topo, node_lease=99) == "this node lost the lease round 1 names it with"


def test_refusals_say_why() -> None:
    assert fence_verdict(0, "C", topology(1, members=("A", "B"), inplace=("A", "B")), None) == (
        "round 1 does not include this node (it left or lost its lease)")
    assert fence_verdict(0, "C", topology(1, inplace=("A", "B")), None) == "round 1 restarted this node's workers"
    assert fence_verdict(0, "A", topology(2, inplace=("A", "B")), 10) == "the job moved on to round 2"
    assert fence_verdict(0, "A", topology(1), None) == "round 1 restarted this node's workers"
    assert fence_verdict(0, "A", None, None) == "the job has no current round"
    assert fence_verdict(4, "A", topology(3), None) == "the job is at round 3, older than this worker's"


def test_the_node_lease_is_read_only_for_a_pending_reform() -> None:
    assert not needs_node_lease(1, "A", raw(topology(1, inplace=("A",))))
    assert not needs_node_lease(0, "C", raw(topology(1, inplace=("A", "B"))))
    assert not needs_node_lease(0, "A", raw(topology(2, inplace=("A", "B"))))
    assert not needs_node_lease(0, "", raw(topology(1, inplace=("A", "B"))))
    assert not needs_node_lease(0, "A", b'{"round": "x"}')
    assert not needs_node_lease(0, "A", None)


def test_refusal_lets_a_pending_survivor_commit():
    value = raw(topology(1, inplace=("A", "B")))
    assert refusal(0, KEY, value, "A", 10) is None
    why = refusal(0, KEY, value, "A", None)
    assert why is not None and "this node lost the lease round 1 names it with" in why, why
