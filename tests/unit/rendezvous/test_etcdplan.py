"""The decision of which nodes run the members of a job's own etcd (rendezvous/etcdplan.py): no etcd, no
processes, a fixed clock."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import pytest

from elasticrun.job.records import BadRecord
from elasticrun.rendezvous.etcdplan import (
    Assign,
    Assignment,
    DropAssignment,
    DropRecord,
    Endpoints,
    MemberRecord,
    Remove,
    Settings,
    Snapshot,
    Wait,
    assignment_record,
    candidates,
    client_endpoints,
    endpoints_record,
    member_record,
    plan,
    target_size,
)
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.store.types import Member

NOW = 1_000_000.0
SETTINGS = Settings()


def node(name: str, host: str = "h", registered_at: float = 0.0, pid: int = 0) -> NodeInfo:
    return NodeInfo(node_id=name, host=host, addr="10.0.0.1", nproc=1, pid=pid or 100 + ord(name[-1]),
                    registered_at=registered_at)


def member(name: str, learner: bool = False, started: bool = True) -> Member:
    i = ord(name[-1])
    return Member(member_id=i, name=name if started else "", peer_urls=(f"http://10.0.0.1:{2000 + i}",),
                      client_urls=(f"http://10.0.0.1:{3000 + i}",) if started else (), learner=learner)


def record(name: str, on: Optional[NodeInfo] = None, member_id: Optional[int] = None, at: float = NOW - 100) -> \
        MemberRecord:
    """The record of member ``name`` run by node ``on`` (default: the node named like the member)."""
    on = on or node(name)
    i = ord(name[-1])
    return MemberRecord(node_id=on.node_id, name=name, peer_url=f"http://10.0.0.1:{2000 + i}",
                        client_url=f"http://10.0.0.1:{3000 + i}", pid=on.pid, host=on.host,
                        member_id=i if member_id is None else member_id, time=at)


def snap(members: Iterable[Member], nodes: Iterable[NodeInfo], records: Iterable[MemberRecord] = (),
         assignments: Iterable[Assignment] = (), first_seen: Optional[Dict[int, float]] = None,
         **kw: object) -> Snapshot:
    """By default the clients were told every listed voter long ago (``published``)."""
    members = tuple(members)
    told = tuple(sorted(u.split("://")[1] for m in members if not m.learner for u in m.client_urls))
    kw.setdefault("published", Endpoints(told, NOW - 100))
    return Snapshot(members=members, records={r.node_id: r for r in records},
                    assignments={a.node_id: a for a in assignments}, nodes={n.node_id: n for n in nodes},
                    first_seen=first_seen if first_seen is not None else {m.member_id: NOW - 100 for m in members},
                    **kw)  # type: ignore[arg-type]


def running(*names: str, extra: Tuple[str, ...] = ()) -> Tuple[list, list, list]:
    """Members, nodes and records of members ``names`` each on its own live node, plus nodes ``extra``."""
    nodes = [node(n) for n in (*names, *extra)]
    return [member(n) for n in names], nodes, [record(n) for n in names]


@pytest.mark.parametrize("live,most,want", [(0, 3, 1), (1, 3, 1), (2, 3, 1), (3, 3, 3), (10, 3, 3), (4, 5, 3),
                                            (5, 5, 5), (6, 5, 5), (3, 1, 1)])
def test_the_size_is_the_largest_odd_number_the_nodes_allow(live: int, most: int, want: int) -> None:
    assert target_size(live, most) == want


def test_a_third_node_gets_a_member_asked_of_the_oldest_node_without_one() -> None:
    members, nodes, records = running("a", extra=("b", "c"))
    nodes = [nodes[0], node("b", registered_at=5.0), node("c", registered_at=3.0)]
    assert plan(snap(members, nodes, records), SETTINGS, NOW) == Assign("c", "1 of 3 members")


def test_two_nodes_keep_one_member() -> None:
    members, nodes, records = running("a", extra=("b",))
    assert isinstance(plan(snap(members, nodes, records), SETTINGS, NOW), Wait)


def test_a_node_on_a_machine_without_a_member_comes_first() -> None:
    a = node("a", host="m1")
    nodes = [a, node("b", host="m1", registered_at=1.0), node("c", host="m2", registered_at=9.0)]
    assert plan(snap([member("a")], nodes, [record("a", a)]), SETTINGS, NOW) == Assign("c", "1 of 3 members")


def test_nothing_changes_while_a_node_starts_a_member_or_a_learner_catches_up() -> None:
    members, nodes, records = running("a", "b", extra=("c",))
    asked = Assignment("c", by="a", time=NOW - 1)
    assert plan(snap(members, nodes, records, [asked]), SETTINGS, NOW) == Wait("node c is starting a member")
    learning = [*members, member("c", learner=True)]
    assert plan(snap(learning, nodes, [*records, record("c")], [asked]), SETTINGS, NOW) == \
        Wait("node c is starting a member")


def test_three_members_on_three_nodes_are_left_alone() -> None:
    members, nodes, records = running("a", "b", "c", extra=("d",))
    action = plan(snap(members, nodes, records), SETTINGS, NOW)
    assert action == Wait("3 member(s) on 3 node(s)")


def test_the_member_of_a_lost_node_is_removed_then_replaced() -> None:
    members, nodes, records = running("a", "b", "c", extra=("d",))
    alive = [n for n in nodes if n.node_id != "b"]
    assert plan(snap(members, alive, records), SETTINGS, NOW) == Remove(ord("b"), "b", "its node b is gone")
    # etcd removed it; its record goes, and node d is asked for a member.
    left = [m for m in members if m.name != "b"]
    assert plan(snap(left, alive, records), SETTINGS, NOW) == DropRecord("b", "etcd has no member b (node b)")
    kept = [r for r in records if r.node_id != "b"]
    assert plan(snap(left, alive, kept), SETTINGS, NOW) == Assign("d", "2 of 3 members")


def test_a_voter_goes_only_once_the_clients_were_told_another_that_stays() -> None:
    """A client that knew only the removed member would be left with none: the endpoints come first."""
    members, nodes, records = running("a", "b", "c", extra=("d",))
    alive = [n for n in nodes if n.node_id != "b"]
    removal = Remove(ord("b"), "b", "its node b is gone")
    waiting = Wait("telling the clients the other members before removing b (its node b is gone)")
    assert plan(snap(members, alive, records, published=None), SETTINGS, NOW) == waiting
    only_b = Endpoints(("10.0.0.1:3098",), NOW - 100)
    assert plan(snap(members, alive, records, published=only_b), SETTINGS, NOW) == waiting
    just_now = Endpoints(("10.0.0.1:3097", "10.0.0.1:3099"), NOW - SETTINGS.settle / 2)
    assert plan(snap(members, alive, records, published=just_now), SETTINGS, NOW) == waiting
    settled = Endpoints(just_now.endpoints, NOW - SETTINGS.settle)
    assert plan(snap(members, alive, records, published=settled), SETTINGS, NOW) == removal
    learner = member("e", learner=True)  # a learner serves no client: it goes at once
    assert plan(snap([*members, learner], nodes, records, published=None), SETTINGS, NOW) == \
        Remove(learner.member_id, "e", "no node runs it")


def test_a_node_that_runs_another_agent_now_has_lost_its_member() -> None:
    """The same node id re-registered by a new agent (another pid): the old agent's member died with it."""
    members, nodes, records = running("a", "b", "c")
    restarted = [n if n.node_id != "c" else node("c", pid=999) for n in nodes]
    assert plan(snap(members, restarted, records), SETTINGS, NOW) == \
        Remove(ord("c"), "c", "node c runs another agent now")


def test_a_missing_node_whose_member_answers_is_given_a_grace() -> None:
    """Its agent may only have lost its lease (a stalled loop) and register again: its member, a process of
    its own, still answers. A member that does not answer is gone at once."""
    members, nodes, records = running("a", "b", "c", extra=("d",))
    alive = [n for n in nodes if n.node_id != "b"]
    answering = snap(members, alive, records, missing={ord("b"): (NOW - 5, True)})
    assert plan(answering, SETTINGS, NOW) == Wait("node b is missing; its member b still answers")
    long_gone = snap(members, alive, records, missing={ord("b"): (NOW - SETTINGS.lost_grace, True)})
    assert plan(long_gone, SETTINGS, NOW) == Remove(ord("b"), "b", "its node b has been gone for 30 s")
    silent = snap(members, alive, records, missing={ord("b"): (NOW - 1, False)})
    assert plan(silent, SETTINGS, NOW) == Remove(ord("b"), "b", "its node b is gone")


def test_the_member_of_a_node_that_left_is_moved_at_once() -> None:
    """A node leaving gracefully marks its member: it serves only until another node has one (a job of two
    nodes survives the leave of the node holding its only member)."""
    a, b = node("a"), node("b")
    leaving = MemberRecord(**{**record("a", a).to_dict(), "leaving": True})
    s = snap([member("a")], [b], [leaving])  # the last voter: another node starts one first
    assert plan(s, SETTINGS, NOW) == Assign("b", "0 of 1 members")
    both = snap([member("a"), member("b")], [b], [leaving, record("b", b)],
                missing={ord("a"): (NOW - 1, True)})  # it still answers: no grace for a node that left
    assert plan(both, SETTINGS, NOW) == Remove(ord("a"), "a", "its node a left")
    assert client_endpoints(both) == ["10.0.0.1:3098"]


def test_three_nodes_down_to_two_keep_one_member_not_the_raft_leader() -> None:
    members, nodes, records = running("a", "b")
    records = [record("a", at=NOW - 50), record("b", at=NOW - 10)]
    assert plan(snap(members, nodes, records, leader_id=ord("a")), SETTINGS, NOW) == \
        Remove(ord("b"), "b", "2 node(s) left: 1 member(s) survive more")
    assert plan(snap(members, nodes, records, leader_id=ord("b")), SETTINGS, NOW).member_id == ord("a")


def test_the_last_voter_is_never_removed() -> None:
    members, nodes, records = running("a", "b")
    gone = [nodes[1]]  # a's node is gone, but its member is the only voter
    assert plan(snap([members[0]], gone, [records[0]]), SETTINGS, NOW) == Assign("b", "0 of 1 members")


def test_a_member_no_record_names_is_waited_for_then_removed() -> None:
    members, nodes, records = running("a", "b", "c")
    stray = member("x")
    fresh = snap([*members, stray], nodes, records, first_seen={stray.member_id: NOW - 1})
    assert plan(fresh, SETTINGS, NOW) == Wait("no record names member x yet")
    old = snap([*members, stray], nodes, records, first_seen={stray.member_id: NOW - SETTINGS.orphan_grace})
    assert plan(old, SETTINGS, NOW) == Remove(stray.member_id, "x", "no node runs it")


def test_the_hosting_member_is_waited_for_until_its_record_is_written() -> None:
    """The first member, before the hosting agent recorded it: nobody adds a member beside it."""
    nodes = [node("a"), node("b"), node("c")]
    assert plan(snap([member("a")], nodes, first_seen={}), SETTINGS, NOW) == Wait("no record names member a yet")
    assert plan(snap([member("a")], nodes, first_seen={ord("a"): 0.0}), SETTINGS, NOW) == \
        Wait("no record names member a yet")


def test_a_learner_nobody_adds_any_more_is_removed() -> None:
    members, nodes, records = running("a", "b", "c")
    learner = member("d", learner=True)
    nodes = [*nodes, node("d")]
    action = plan(snap([*members, learner], nodes, [*records, record("d")]), SETTINGS, NOW)
    assert action == Remove(learner.member_id, "d", "node d did not make it a voting member")


def test_a_learner_not_started_of_a_lost_node_is_removed() -> None:
    members, nodes, records = running("a", "b", extra=("c",))
    learner = member("d", learner=True, started=False)
    rec = record("d", node("d"), member_id=0)
    assert plan(snap([*members, learner], nodes, [*records, rec]), SETTINGS, NOW) == \
        Remove(learner.member_id, "d", "its node d is gone")


def test_requests_are_dropped_when_refused_late_or_their_node_is_gone() -> None:
    members, nodes, records = running("a", extra=("b", "c"))
    refused = Assignment("b", by="a", time=NOW - 1, failed="port in use")
    assert plan(snap(members, nodes, records, [refused]), SETTINGS, NOW) == \
        DropAssignment("b", "node b could not start a member: port in use", failed=True)
    late = Assignment("b", by="a", time=NOW - SETTINGS.assign_timeout)
    assert plan(snap(members, nodes, records, [late]), SETTINGS, NOW) == \
        DropAssignment("b", "node b has no voting member after 60 s", failed=True)
    gone = Assignment("z", by="a", time=NOW - 1)
    assert plan(snap(members, nodes, records, [gone]), SETTINGS, NOW) == DropAssignment("z", "node z is gone")


def test_a_node_that_failed_to_start_a_member_is_skipped_for_a_while() -> None:
    members, nodes, records = running("a", extra=("b", "c"))
    s = snap(members, nodes, records, refused={"b": NOW - 1})
    assert [n.node_id for n in candidates(s, SETTINGS, NOW)] == ["c"]
    later = snap(members, nodes, records, refused={"b": NOW - SETTINGS.refused_for})
    assert [n.node_id for n in candidates(later, SETTINGS, NOW)] == ["b", "c"]


def test_no_candidate_means_waiting() -> None:
    members, nodes, records = running("a", extra=("b", "c"))
    s = snap(members, nodes, records, refused={"b": NOW, "c": NOW})
    assert plan(s, SETTINGS, NOW) == Wait("1 of 3 members: no other node can start one")


def test_an_ended_job_changes_nothing() -> None:
    members, nodes, records = running("a", "b", "c")
    assert plan(snap(members, nodes[:1], records, ended=True), SETTINGS, NOW) == Wait("the job ended")


def test_an_addition_whose_record_was_written_but_not_added_is_forgotten_after_the_grace() -> None:
    members, nodes, records = running("a", extra=("b", "c"))
    pending = record("b", member_id=0, at=NOW - 1)  # b may still be adding it: kept, b is not asked again
    assert plan(snap(members, nodes, [*records, pending]), SETTINGS, NOW) == Assign("c", "1 of 3 members")
    old = record("b", member_id=0, at=NOW - SETTINGS.orphan_grace)
    assert plan(snap(members, nodes, [*records, old]), SETTINGS, NOW) == \
        DropRecord("b", "etcd has no member b (node b)")


def test_clients_get_the_voting_members_live_agents_run() -> None:
    members, nodes, records = running("a", "b", "c")
    s = snap([*members, member("d", learner=True)], nodes[:2], [*records, record("d")])
    assert client_endpoints(s) == ["10.0.0.1:3097", "10.0.0.1:3098"]  # c's node is gone, d only learns


def test_records_are_checked() -> None:
    rec = record("a")
    assert member_record(rec.to_dict()) == rec
    assert assignment_record({"node_id": "b", "by": "a", "time": 1.0}) == Assignment("b", "a", 1.0)
    assert endpoints_record({"endpoints": ["h:1", "h:2"], "time": 1}) == Endpoints(("h:1", "h:2"), 1.0)
    for bad in ({"endpoints": []}, {"endpoints": "h:1"}, {"endpoints": [1]}, []):
        with pytest.raises(BadRecord):
            endpoints_record(bad)
    with pytest.raises(BadRecord):
        member_record({**rec.to_dict(), "pid": "1"})
    with pytest.raises(BadRecord):
        assignment_record({"node_id": "b", "time": 1.0})


def test_two_members_stranded_on_the_way_to_three_shrink_to_one() -> None:
    """The third node could not start its member: two members would stop with either one, so one goes."""
    members, nodes, records = running("a", "b", extra=("c",))
    s = snap(members, nodes, records, refused={"c": NOW - 1}, leader_id=member("a").member_id)
    assert plan(s, SETTINGS, NOW) == Remove(member("b").member_id, "b",
                                            "no other node can start a member (2 of 3): 1 member(s) survive more")
    alone = snap(members[:1], nodes, records[:1], refused={"c": NOW - 1})
    assert plan(alone, SETTINGS, NOW) == Wait("1 of 3 members: no other node can start one")  # b is not asked again
    later = snap(members[:1], nodes, records[:1], refused={"c": NOW - SETTINGS.refused_for})
    assert plan(later, SETTINGS, NOW) == Assign("b", "1 of 3 members")
