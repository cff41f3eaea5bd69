"""The commit fence's decision (:func:`elasticrun.job.fence.fence_verdict`), without etcd."""

from __future__ import annotations

from typing import Optional, Sequence

from elasticrun.job.fence import fence_verdict, needs_node_lease


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
    assert needs_node_lease(0, "A", topo)
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
    assert not needs_node_lease(1, "A", topology(1, inplace=("A",)))
    assert not needs_node_lease(0, "C", topology(1, inplace=("A", "B")))
    assert not needs_node_lease(0, "A", topology(2, inplace=("A", "B")))
    assert not needs_node_lease(0, "", topology(1, inplace=("A", "B")))
    assert not needs_node_lease(0, "A", {"round": "x"})
