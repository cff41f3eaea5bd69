"""Why a running round ends, and when the leader ends it (rendezvous/roundend.py): every branch of
round_end and plan_scale_up on plain snapshots with a fake clock."""

from __future__ import annotations

from typing import Dict, Tuple

from elasticrun.rendezvous.records import Member, NodeInfo, Topology
from elasticrun.rendezvous.roundend import Ended, LoseMember, RunningRound, Runs, ScaleUp, plan_scale_up, round_end
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.states import RoundOutcome


def settings(**kw) -> RendezvousSettings:
    base = dict(job_id="j", min_nodes=1, max_nodes=4, max_restarts=0, heartbeat_timeout=5.0, stability_window=2.0,
                rescale_timeout=30.0, join_timeout=60.0)
    base.update(kw)
    return RendezvousSettings(**base)


def topo(ids: str, round_: int = 3) -> Topology:
    return Topology(round_, tuple(Member(n, "h", "a", 1, i, i, lease=ord(n)) for i, n in enumerate(ids)), "a", 1)


def nodes(ids: str, waiting_for: int = -1) -> Dict[str, Tuple[NodeInfo, int]]:
    return {n: (NodeInfo(n, "h", "a", 1, 1, waiting_for=waiting_for), ord(n)) for n in ids}


def running(**kw) -> RunningRound:
    t = kw.pop("topo", topo("AB"))
    return RunningRound(t, kw.pop("current", t), **kw)


# -- round_end --------------------------------------------------------------------------------------


def test_a_round_with_nothing_new_runs_on():
    assert round_end(running()) == Runs(checked=False), "nothing looked at: no check to remember"
    assert round_end(running(nodes=nodes("AB"))) == Runs(checked=True)


def test_the_job_state_ends_every_round():
    assert round_end(running(state={"state": "failed"}, failed={"node": "A"})) == Ended("job failed")


def test_a_newer_or_missing_round_record_ends_the_round():
    assert round_end(running(current=topo("AB", 4))) == Ended("a newer round was formed")
    assert round_end(running(current=None)) == Ended("a newer round was formed")


def test_the_failure_flag_then_the_end_record_say_why():
    failed = round_end(running(failed={"node": "B"}, end={"reason": "scale-up"}))
    assert failed == Ended("worker failure on B")
    assert round_end(running(failed={})) == Ended("worker failure on ?")
    assert round_end(running(end={"reason": "scale-up: 1 node(s) joined (C)"})) == \
        Ended("scale-up: 1 node(s) joined (C)")
    assert round_end(running(end={})) == Ended("round ended")


def test_the_leader_ends_the_round_for_a_member_gone_or_under_another_lease():
    gone = round_end(running(nodes=nodes("A")))
    assert gone == LoseMember("B") and gone.reason == "node B left or lost its lease"
    other = nodes("AB")
    other["A"] = (other["A"][0], 99)
    assert round_end(running(nodes=other)) == LoseMember("A")


def test_a_member_that_rejoined_after_an_outage_is_checked_against_the_current_round():
    t = topo("AB")
    rejoined = Topology(t.round, (t.members[0], Member("B", "h", "a", 1, 1, 1, lease=99)), "a", 1)
    fresh = nodes("AB")
    fresh["B"] = (fresh["B"][0], 99)
    assert round_end(RunningRound(t, rejoined, nodes=fresh)) == Runs(checked=True)


def test_after_an_outage_a_missing_member_may_still_rejoin():
    assert round_end(running(nodes=nodes("A"), unreachable=True)) == Runs(checked=False), "look again later"


def test_every_member_done_is_success():
    assert round_end(running(done=1)) == Runs()
    assert round_end(running(done=2)) == Ended(RoundOutcome.SUCCEEDED)
    assert round_end(running(done=2, nodes=nodes("A"))) == LoseMember("B"), "a lost member first"


# -- plan_scale_up ----------------------------------------------------------------------------------


def test_no_newcomer_closes_the_window():
    s = settings()
    assert plan_scale_up(topo("AB"), None, False, 5.0, s, 10.0) == ScaleUp(None), "not the leader"
    assert plan_scale_up(topo("AB"), nodes("AB"), False, 5.0, s, 10.0) == ScaleUp(None), "only members"


def test_a_full_or_finishing_round_takes_no_newcomer():
    assert plan_scale_up(topo("AB"), nodes("ABC"), False, None, settings(max_nodes=2), 10.0) == ScaleUp(None)
    assert plan_scale_up(topo("AB"), nodes("ABC"), True, None, settings(), 10.0) == ScaleUp(None)


def test_a_newcomer_opens_the_window_once():
    s = settings()
    first = plan_scale_up(topo("AB"), nodes("ABDC"), False, None, s, 10.0)
    assert first == ScaleUp(10.0, announce=("C", "D"), due=2.0)
    again = plan_scale_up(topo("AB"), nodes("ABDC"), False, first.since, s, 11.5)
    assert again == ScaleUp(10.0, due=0.5), "announced once; the window keeps its opening"


def test_the_round_ends_for_ready_newcomers_once_the_window_closed():
    s = settings()
    n = nodes("AB") | nodes("C", waiting_for=4) | nodes("D")  # C waits for round 4, D still starts
    assert plan_scale_up(topo("AB"), n, False, 10.0, s, 11.9).end_reason == ""
    assert plan_scale_up(topo("AB"), n, False, 10.0, s, 12.0) == ScaleUp(10.0, end_reason="scale-up: 1 node(s) "
                                                                                           "joined (C)")


def test_a_closed_window_without_a_ready_newcomer_waits_for_its_record():
    assert plan_scale_up(topo("AB"), nodes("ABC"), False, 10.0, settings(), 20.0) == ScaleUp(10.0, due=None)


def test_a_zero_window_ends_the_round_at_first_sight():
    n = nodes("AB") | nodes("C", waiting_for=4)
    assert plan_scale_up(topo("AB"), n, False, None, settings(stability_window=0.0), 7.0) == \
        ScaleUp(7.0, ("C",), "scale-up: 1 node(s) joined (C)")
