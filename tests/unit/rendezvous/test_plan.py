"""Forming a round, decided (rendezvous/plan.py): every branch of check_formed and plan_round on plain
snapshots with a fake clock — no etcd, no threads."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import pytest

from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.inplace import EXIT_INPLACE_FAILED, RECOVERABLE
from elasticrun.rendezvous.plan import (
    EndJob,
    Fence,
    Forming,
    FormRound,
    GiveUp,
    JobOver,
    Joined,
    Marks,
    PassedOver,
    Wait,
    check_formed,
    plan_round,
    waiting_message,
)
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.states import JobState

WALL = 1_000_000.0  # the wall clock of every snapshot
T0 = 500.0  # the monotonic clock when the node began to wait


def settings(**kw) -> RendezvousSettings:
    base = dict(job_id="j", min_nodes=2, max_nodes=3, max_restarts=2, heartbeat_timeout=5.0, stability_window=1.0,
                rescale_timeout=30.0, join_timeout=60.0, busy_timeout=10.0)
    base.update(kw)
    return RendezvousSettings(**base)


def lease(nid: str) -> int:
    return 1000 + ord(nid)


def node(nid: str, waiting_for: int = 0, port: int = 29500, lease_id: Optional[int] = None,
         inplace: bool = False) -> Tuple[NodeInfo, int]:
    """Node ``nid``'s record (registered in the order of its letter) and its lease."""
    info = NodeInfo(nid, "h", f"10.0.0.{ord(nid)}", 1, 1, waiting_for=waiting_for, store_port=port,
                    registered_at=float(ord(nid)), inplace=inplace)
    return info, lease(nid) if lease_id is None else lease_id


def nodes(ids: str, waiting_for: int = 0, inplace: bool = False) -> Dict[str, Tuple[NodeInfo, int]]:
    return {n: node(n, waiting_for, inplace=inplace) for n in ids}


def topo(ids: str, round_: int = 0, restarts: int = 0, **kw) -> Topology:
    members = tuple(Member(n, "h", f"10.0.0.{ord(n)}", 1, i, i, lease=lease(n)) for i, n in enumerate(ids))
    return Topology(round_, members, "10.0.0.65", 29500, restart_count=restarts, created_at=WALL - 100, **kw)


def snap(ids: str = "AB", target: int = 0, prev: Optional[Topology] = None, **kw) -> Forming:
    kw.setdefault("nodes", nodes(ids, target))
    kw.setdefault("marks", Marks(changed_at=T0))
    return Forming(target=target, me="A", prev=prev, started=T0, timeout=60.0, wall=WALL, **kw)


# -- check_formed ---------------------------------------------------------------------------------


def test_a_lost_lease_fences_before_anything_else():
    assert check_formed("expired", {"state": "failed"}, topo("AB"), 0, "A", lease("A"), True) == Fence("expired")


def test_a_terminal_state_ends_the_wait_and_says_whether_we_ran():
    state = {"state": "succeeded"}
    assert check_formed(None, state, None, 0, "A", lease("A"), ran=False) == JobOver(state, spare=True)
    assert check_formed(None, state, topo("AB"), 1, "A", lease("A"), ran=True) == JobOver(state, spare=False)


def test_our_round_formed_with_us_under_our_lease():
    t = topo("AB", 3)
    assert check_formed(None, None, t, 3, "A", lease("A"), False) == Joined(t)
    assert check_formed(None, None, t, 2, "B", lease("B"), False) == Joined(t), "a newer round than awaited"


def test_a_round_without_us_or_with_an_older_incarnation_of_us_passes_us_over():
    t = topo("AB", 3)
    over = check_formed(None, None, t, 3, "C", lease("C"), False)
    assert over == PassedOver(t) and over.target == 4
    assert check_formed(None, None, t, 3, "A", 77, False) == PassedOver(t), "our record under another lease"
    assert check_formed(None, None, t, 3, "A", None, False) == PassedOver(t)


def test_the_wait_goes_on_while_no_round_at_or_past_the_target_exists():
    assert check_formed(None, None, None, 0, "A", lease("A"), False) is None
    assert check_formed(None, None, topo("AB", 2), 3, "A", lease("A"), True) is None
    assert check_formed(None, {}, None, 0, "A", lease("A"), False) is None, "an empty state record ends nothing"


def test_waiting_messages():
    s = settings(max_nodes=2)
    full = waiting_message(s, "C", topo("AB"), 1, "A")
    assert full.startswith("job 'j' is full: round 0 runs with its maximum of 2 node(s) (--nnodes 2:2)")
    assert waiting_message(settings(), "C", topo("AB"), 1, None, passed_over=True) == \
        "round 0 formed without this node; waiting for round 1"
    assert waiting_message(settings(), "A", None, 0, "B") == "waiting for round 0, formed by B"
    assert waiting_message(settings(), "A", None, 0, None) == "waiting for round 0, formed by ?"


# -- plan_round: when to form -----------------------------------------------------------------------


def test_our_own_record_not_yet_in_the_view_looks_again_soon():
    plan = plan_round(snap("BC"), settings(), T0 + 1)
    assert isinstance(plan, Wait) and plan.soon and plan.marks == Marks(changed_at=T0)


def test_below_min_waits_and_says_how_many_joined():
    plan = plan_round(snap("A"), settings(), T0 + 1)
    assert isinstance(plan, Wait) and not plan.soon
    assert plan.reason == "waiting for nodes: 1/2 (min) joined"
    assert plan.marks.waiting == ("A",) and plan.marks.changed_at == T0 + 1, "the waiting set changed now"


def test_the_first_round_waits_a_stability_window_for_more_nodes_up_to_max():
    s = settings()
    marks = Marks(waiting=("A", "B"), changed_at=T0)
    plan = plan_round(snap("AB", marks=marks), s, T0 + 0.5)
    assert isinstance(plan, Wait) and plan.reason == "2 node(s) joined; waiting 1.0s for more (max 3)"
    assert plan.marks is marks, "the same waiting set keeps its clock"
    later = plan_round(snap("AB", marks=marks), s, T0 + 1.0)
    assert isinstance(later, FormRound) and later.topology.node_ids == ["A", "B"]
    newcomer = plan_round(snap("ABD", marks=marks), s, T0 + 1.0)
    assert isinstance(newcomer, FormRound), "max nodes: no window to wait"
    grew = plan_round(snap("AB", nodes=nodes("AB") | {"D": node("D", 5)}, marks=Marks(("A",), T0)), s, T0 + 5)
    assert isinstance(grew, Wait) and grew.marks.changed_at == T0 + 5, "a new node restarts the window"


def test_a_round_after_the_first_forms_without_a_stability_window():
    prev = topo("AB")
    plan = plan_round(snap("AB", 1, prev, marks=Marks(("A", "B"), T0)), settings(), T0)
    assert isinstance(plan, FormRound) and plan.topology.round == 1


def test_the_first_round_forms_with_its_members_ranks_event_and_time():
    plan = plan_round(snap("BAC", marks=Marks(("A", "B", "C"), T0)), settings(), T0)
    assert isinstance(plan, FormRound) and plan.note == "" and plan.restarts is None
    t = plan.topology
    assert [(m.node_id, m.group_rank, m.lease) for m in t.members] == [("A", 0, lease("A")), ("B", 1, lease("B")),
                                                                       ("C", 2, lease("C"))], "by join time"
    assert (t.master_addr, t.master_port, t.restart_count, t.created_at, t.inplace) == ("10.0.0.65", 29500, 0, WALL, ())
    e = plan.event
    assert (e.type, e.round, e.old_members, e.new_members, e.reason, e.time) == (
        RescaleType.START, 0, [], ["A", "B", "C"], "job start", WALL)


def test_spares_beyond_max_wait_and_survivors_come_first():
    prev = topo("BC")
    plan = plan_round(snap("ABCD", 1, prev, marks=Marks(("A", "B", "C", "D"), T0)), settings(), T0)
    assert isinstance(plan, FormRound)
    assert plan.topology.node_ids == ["B", "C", "A"], "survivors in their order, then the earliest newcomer"
    assert plan.event.type is RescaleType.SCALE_UP


def test_rank_zero_without_its_store_port_yet_waits():
    n = nodes("AB") | {"A": node("A", 0, port=0)}
    plan = plan_round(snap("AB", nodes=n, marks=Marks(("A", "B"), T0 - 5)), settings(max_nodes=2), T0)
    assert isinstance(plan, Wait) and plan.reason == "round 0 is ready: waiting for A to start its c10d store"


# -- plan_round: busy members ---------------------------------------------------------------------


def test_members_still_stopping_their_workers_are_waited_for_up_to_busy_timeout():
    prev = topo("ABC")
    n = nodes("AB", 1) | {"C": node("C", -1)}  # C still runs its workers (waiting_for -1)
    s = settings()
    first = plan_round(snap("ABC", 1, prev, nodes=n), s, T0 + 1)
    assert isinstance(first, Wait) and first.reason == "waiting for 1 node(s) of round 0 to stop their workers"
    assert first.marks.busy_since == (0, T0 + 1)
    still = plan_round(snap("ABC", 1, prev, nodes=n, marks=first.marks), s, T0 + 10.9)
    assert isinstance(still, Wait) and still.marks.busy_since == (0, T0 + 1), "the clock runs from the first sight"
    late = plan_round(snap("ABC", 1, prev, nodes=n, marks=first.marks), s, T0 + 11)
    assert isinstance(late, FormRound) and late.topology.node_ids == ["A", "B"]
    assert late.note == "node(s) C did not stop their workers within 10s: forming the next round without them"


def test_busy_since_of_an_older_round_starts_again():
    prev = topo("ABC", 4)
    n = nodes("AB", 5) | {"C": node("C", -1)}
    plan = plan_round(snap("ABC", 5, prev, nodes=n, marks=Marks(busy_since=(2, 0.0))), settings(), T0)
    assert isinstance(plan, Wait) and plan.marks.busy_since == (4, T0)


def test_a_member_under_a_new_lease_is_not_busy():
    prev = topo("ABC")
    n = nodes("AB", 1) | {"C": node("C", -1, lease_id=55)}  # C rejoined: a new incarnation, not a busy member
    plan = plan_round(snap("ABC", 1, prev, nodes=n, marks=Marks(("A", "B"), T0)), settings(), T0)
    assert isinstance(plan, FormRound) and plan.event.type is RescaleType.SCALE_DOWN


# -- plan_round: restarts -------------------------------------------------------------------------


def test_a_worker_failure_uses_a_restart_and_records_it():
    prev = topo("AB", 2, restarts=1)
    s = settings(max_restarts=3)
    plan = plan_round(snap("AB", 3, prev, failed={"node": "B", "time": WALL - 1}, restarts=(WALL - 50,)), s, T0)
    assert isinstance(plan, FormRound)
    assert plan.topology.restart_count == 2 and plan.event.restart_count == 2
    assert plan.event.type is RescaleType.RESTART and plan.event.reason == "worker failure in round 2"
    assert plan.restarts == (WALL - 50, WALL), "the history gets this restart's wall time"


def test_the_restart_budget_used_up_ends_the_job():
    prev = topo("AB", 2, restarts=2)
    plan = plan_round(snap("AB", 3, prev, failed={"node": "B"}), settings(max_restarts=2), T0)
    assert plan == EndJob(JobState.FAILED, "workers failed and all 2 restart(s) are used up", plan.marks)


def test_a_windowed_budget_counts_only_recent_restarts():
    prev = topo("AB", 2, restarts=5)
    s = settings(max_restarts=1, restart_window=3600.0)
    old = plan_round(snap("AB", 3, prev, failed={"node": "B"}, restarts=(WALL - 7200,)), s, T0)
    assert isinstance(old, FormRound) and old.restarts == (WALL,), "the old restart left the window"
    recent = plan_round(snap("AB", 3, prev, failed={"node": "B"}, restarts=(WALL - 60,)), s, T0)
    assert isinstance(recent, EndJob) and recent.reason == "workers failed and all 1 restart(s) within 1h are used up"


@pytest.mark.parametrize("ids,kind", [("A", RescaleType.SCALE_DOWN), ("AC", RescaleType.REPLACE)])
def test_a_failure_with_a_lost_node_is_a_membership_change_not_a_restart(ids, kind):
    prev = topo("AB", 2)
    n = nodes(ids, 3)
    plan = plan_round(snap(ids, 3, prev, nodes=n, failed={"node": "A"}), settings(min_nodes=1, max_restarts=0), T0)
    assert isinstance(plan, FormRound) and plan.event.type is kind
    assert plan.restarts is None and plan.topology.restart_count == 0, "a lost node costs no restart"
    assert plan.event.reason == "worker failure in round 2 and membership change"


def test_a_failure_with_a_newcomer_still_uses_a_restart():
    prev = topo("AB", 2)
    plan = plan_round(snap("ABC", 3, prev, failed={"node": "A"}), settings(max_restarts=1), T0)
    assert isinstance(plan, FormRound) and plan.event.type is RescaleType.SCALE_UP
    assert plan.topology.restart_count == 1 and plan.restarts == (WALL,)
    assert plan.event.reason == "worker failure in round 2 and membership change"


def test_a_failed_inplace_reform_is_not_charged():
    prev = topo("AB", 2, inplace=("A",))
    rows = ({"rank": 0, "exitcode": EXIT_INPLACE_FAILED},)
    s = settings(max_restarts=0)
    late = {"node": "A", "time": prev.created_at + 10_000}
    plan = plan_round(snap("AB", 3, prev, failed=late, failure_rows=rows), s, T0)
    assert isinstance(plan, FormRound) and plan.topology.restart_count == 0 and plan.restarts is None
    assert plan.event.type is RescaleType.RESTART and plan.topology.inplace == (), "never in place after a failure"
    charged = plan_round(snap("AB", 3, prev, failed=late, failure_rows=({"rank": 0, "exitcode": 1},)), s, T0)
    assert isinstance(charged, EndJob), "an ordinary crash late in the round is charged"


def test_a_crash_recovered_in_place_uses_a_restart_and_keeps_the_other_nodes():
    prev = topo("ABC", 2)
    rows = ({"node_id": "B", "rank": 1, "exitcode": 1, RECOVERABLE: True},)
    n = nodes("ABC", 3, inplace=True)
    plan = plan_round(snap("ABC", 3, prev, nodes=n, failed={"node": "B"}, failure_rows=rows), settings(max_restarts=1),
                      T0)
    assert isinstance(plan, FormRound) and plan.topology.inplace == ("A", "C")
    assert plan.event.type is RescaleType.RESTART and plan.topology.restart_count == 1 and plan.restarts == (WALL,)
    spent = plan_round(snap("ABC", 3, prev, nodes=n, failed={"node": "B"}, failure_rows=rows), settings(max_restarts=0),
                       T0)
    assert isinstance(spent, EndJob), "no restart left: the job fails, in place or not"


def _crashed_b(nid: str = "B", target: int = 3) -> Dict[str, Tuple[NodeInfo, int]]:
    """A, B, C wait for round ``target`` opted in; ``nid`` offers to sit it out (its worker crashed)."""
    n = nodes("ABC", target, inplace=True)
    info, lease_id = n[nid]
    n[nid] = (replace(info, sits_out=target, inplace=False), lease_id)
    return n


def test_a_crashed_node_sits_out_when_the_others_are_enough_and_reform_in_place():
    prev = topo("ABC", 2)
    rows = ({"node_id": "B", "rank": 1, "exitcode": 1, RECOVERABLE: True},)
    plan = plan_round(snap("ABC", 3, prev, nodes=_crashed_b(), failed={"node": "B"}, failure_rows=rows),
                      settings(max_restarts=1), T0)
    assert isinstance(plan, FormRound) and plan.topology.node_ids == ["A", "C"]
    assert plan.topology.inplace == ("A", "C") and plan.event.type is RescaleType.SCALE_DOWN
    assert plan.topology.restart_count == 1 and plan.restarts == (WALL,), "the crash uses a restart"
    assert plan.event.recovers, "the agents count it as a recovery (in place), not a rescale"
    assert plan.event.kept == ["A", "C"], "status shows who re-formed in place"
    assert plan.event.reason == "worker failure in round 2: the others re-form at once, B rejoins once restarted"
    spent = plan_round(snap("ABC", 3, prev, nodes=_crashed_b(), failed={"node": "B"}, failure_rows=rows),
                       settings(max_restarts=0), T0)
    assert isinstance(spent, EndJob), "no restart left: the job fails, sitting out or not"


def test_a_crashed_rank_0_sits_out_and_the_next_node_sends_the_state():
    prev = topo("ABC", 2)
    rows = ({"node_id": "A", "rank": 0, "exitcode": 1, RECOVERABLE: True},)
    plan = plan_round(snap("ABC", 3, prev, nodes=_crashed_b("A"), failed={"node": "A"}, failure_rows=rows),
                      settings(), T0)
    assert isinstance(plan, FormRound) and plan.topology.node_ids == ["B", "C"] and plan.topology.inplace == ("B", "C")
    assert plan.topology.master_addr == "10.0.0.66", "B hosts the round's c10d store"


def test_a_crashed_node_is_a_member_when_sitting_out_would_not_keep_the_others_in_place():
    prev = topo("ABC", 2)
    rows = ({"node_id": "B", "rank": 1, "exitcode": 1, RECOVERABLE: True},)
    fixed = plan_round(snap("ABC", 3, prev, nodes=_crashed_b(), failed={"node": "B"}, failure_rows=rows),
                       settings(min_nodes=3), T0)
    assert isinstance(fixed, FormRound) and fixed.topology.node_ids == ["A", "B", "C"], "--nnodes min: B is needed"
    assert fixed.topology.inplace == ("A", "C") and fixed.event.type is RescaleType.RESTART
    rank0 = ({"node_id": "A", "rank": 0, "exitcode": 1, RECOVERABLE: True},)
    fixed0 = _crashed_b("A")
    fixed0["A"] = (replace(fixed0["A"][0], node_rank=0), fixed0["A"][1])
    plan = plan_round(snap("ABC", 3, prev, nodes=fixed0, failed={"node": "A"}, failure_rows=rank0), settings(), T0)
    assert isinstance(plan, FormRound) and plan.topology.node_ids == ["A", "B", "C"], "--node-rank 0 stays rank 0"
    assert plan.topology.inplace == () and plan.event.type is RescaleType.RESTART
    unflagged = ({"node_id": "B", "rank": 1, "exitcode": 1},)
    plan = plan_round(snap("ABC", 3, prev, nodes=_crashed_b(), failed={"node": "B"}, failure_rows=unflagged),
                      settings(), T0)
    assert isinstance(plan, FormRound) and plan.topology.node_ids == ["A", "B", "C"] and plan.topology.inplace == ()
    stale = _crashed_b(target=2)  # an offer for an earlier round is no offer for this one
    stale = {k: (replace(v[0], waiting_for=3), v[1]) for k, v in stale.items()}
    plan = plan_round(snap("ABC", 3, prev, nodes=stale, failed={"node": "B"}, failure_rows=rows), settings(), T0)
    assert isinstance(plan, FormRound) and plan.topology.node_ids == ["A", "B", "C"]


# -- plan_round: in place, reasons ----------------------------------------------------------------


def test_a_leave_or_a_lost_node_of_opted_in_survivors_reforms_in_place():
    prev = topo("ABC", 1)
    n = nodes("AB", 2, inplace=True)
    s = settings(min_nodes=1)
    down = plan_round(snap("AB", 2, prev, nodes=n), s, T0)
    assert isinstance(down, FormRound) and down.topology.inplace == ("A", "B")
    assert down.event.reason == "node(s) left or lost their lease" and down.event.type is RescaleType.SCALE_DOWN
    assert down.topology.restart_count == 0 and down.restarts is None, "a node's loss uses no restart"


def test_the_end_record_says_why_the_round_changed():
    prev = topo("AB", 1)
    plan = plan_round(snap("ABC", 2, prev, end={"reason": "scale-up: 1 node(s) joined (C)"}), settings(), T0)
    assert isinstance(plan, FormRound) and plan.event.reason == "scale-up: 1 node(s) joined (C)"
    same = plan_round(snap("AB", 2, prev), settings(), T0)
    assert isinstance(same, FormRound) and same.event.reason == "round ended"


# -- plan_round: too few nodes for too long ---------------------------------------------------------


def test_too_few_nodes_for_the_first_round_gives_up_without_an_end():
    s = settings(min_nodes=3)
    assert isinstance(plan_round(snap("AB"), s, T0 + 60), Wait), "at the deadline, not past it"
    plan = plan_round(snap("AB"), s, T0 + 60.5)
    assert plan == GiveUp("only 2 of at least 3 nodes joined within 60s", end_job=False)
    assert plan.exit_code == ExitCode.TRANSIENT


def test_a_lost_member_never_replaced_fails_the_job_and_says_who_and_when():
    prev = topo("ABC", 4)
    end = {"reason": "node C left or lost its lease", "lost": "C", "time": 1_700_000_000.0}
    plan = plan_round(snap("AB", 5, prev, end=end), settings(min_nodes=3), T0 + 61)
    assert isinstance(plan, GiveUp) and plan.end_job
    assert plan.reason == ("node C of round 4 left or lost its lease at 2023-11-14 22:13:20 UTC, and no node replaced "
                           "it within 60s (--rescale-timeout): 2 node(s) left, at least 3 needed")
    failed_first = plan_round(snap("A", 5, prev, failed={"node": "A", "time": 1_700_000_000.0}),
                              settings(min_nodes=3), T0 + 61)
    assert isinstance(failed_first, GiveUp)
    assert failed_first.reason.startswith("nodes B, C of round 4 left or lost its lease at 2023-11-14 22:13:20 UTC")


def test_busy_members_past_the_deadline_still_give_up_when_too_few():
    prev = topo("ABC", 0)
    n = nodes("A", 1) | {"B": node("B", -1)}
    plan = plan_round(snap("AB", 1, prev, nodes=n), settings(min_nodes=3), T0 + 61)
    assert isinstance(plan, GiveUp) and plan.reason.startswith("nodes B, C of round 0 left or lost its lease, and no")


def test_marks_are_returned_not_kept():
    s = snap("A")
    plan = plan_round(s, settings(), T0 + 3)
    assert s.marks == Marks(changed_at=T0) and plan.marks == replace(s.marks, waiting=("A",), changed_at=T0 + 3)
