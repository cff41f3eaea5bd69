"""Who re-forms in place (rendezvous/inplace.py: plan_inplace), and which failed round is a failed re-form
(inplace_failed): pure decisions on records already read."""

from __future__ import annotations

from elasticrun.job.inplace import DURING_INPLACE, EXIT_INPLACE_FAILED, RECOVERABLE
from elasticrun.rendezvous.inplace import collectives_broke, inplace_failed, keeps_through_failure, plan_inplace
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology


def _member(nid: str, rank: int) -> Member:
    return Member(nid, "h", "127.0.0.1", 1, rank, rank, lease=ord(nid))


def _topo(ids: str, round_: int = 0) -> Topology:
    return Topology(round_, tuple(_member(n, i) for i, n in enumerate(ids)), "127.0.0.1", 1)


def _nodes(opted: str, ids: str = "ABC"):
    return {n: (NodeInfo(n, "h", "127.0.0.1", 1, 1, inplace=n in opted), ord(n)) for n in ids}


def test_join_reforms_survivors_only_when_all_opted_in():
    prev, new = _topo("AB"), _topo("ABC", 1).members
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, False, _nodes("AB")) == ("A", "B")
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, False, _nodes("A")) == ()
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, True, _nodes("AB")) == (), "a failure restarts"
    assert plan_inplace(prev, new, RescaleType.RESTART, False, _nodes("AB")) == ()
    assert plan_inplace(None, new, RescaleType.START, False, _nodes("ABC")) == ()


def test_a_leave_or_a_lost_node_reforms_the_survivors():
    """Graceful or not: the survivors' collectives with a lost node's dead workers fail, and they wait
    in ``InPlace.recover`` for the re-form (a node's loss uses no restart either way)."""
    prev, new = _topo("ABC"), (_member("A", 0), _member("C", 1))
    assert plan_inplace(prev, new, RescaleType.SCALE_DOWN, False, _nodes("AC")) == ("A", "C")
    assert plan_inplace(prev, new, RescaleType.SCALE_DOWN, False, _nodes("A")) == (), "C did not opt in"
    assert plan_inplace(prev, (_member("C", 0),), RescaleType.SCALE_DOWN, False, _nodes("C")) == ("C",), \
        "rank 0's node lost: C is rank 0 now, a survivor"


def test_rank_zero_must_survive_and_survivors_keep_their_lease():
    prev = _topo("AB")
    newcomer_first = (_member("C", 0), _member("A", 1), _member("B", 2))
    assert plan_inplace(prev, newcomer_first, RescaleType.SCALE_UP, False, _nodes("AB")) == (), \
        "the state is broadcast from rank 0: a newcomer cannot be it"
    rejoined = (Member("A", "h", "127.0.0.1", 1, 0, 0, lease=999), _member("B", 1), _member("C", 2))
    assert plan_inplace(prev, rejoined, RescaleType.SCALE_UP, False, _nodes("AB")) == (), \
        "A under a new lease is a new incarnation, and rank 0 is then no survivor"


def test_only_a_failed_reform_of_an_inplace_round_is_free():
    """The restart after a failed in-place re-form is not charged; a crash in an ordinary round, or
    after the re-form (however soon), is."""
    members = (_member("A", 0), _member("B", 1))
    inplace = Topology(4, members, "127.0.0.1", 1, created_at=1000.0, inplace=("A",))
    ordinary = Topology(4, members, "127.0.0.1", 1, created_at=1000.0)
    assert not inplace_failed(inplace, []), "no failure recorded"
    crash = [{"rank": 1, "exitcode": 1}]
    assert not inplace_failed(inplace, crash), "a crash outside the re-form is charged, however soon"
    could_not = crash + [{"rank": 0, "exitcode": EXIT_INPLACE_FAILED}]
    assert inplace_failed(inplace, could_not), "a worker that could not re-form"
    assert not inplace_failed(ordinary, could_not), "exit 75 outside an in-place round is a plain failure"
    in_reform = crash + [{"rank": 2, "exitcode": 3, DURING_INPLACE: True}]
    assert inplace_failed(inplace, in_reform), "a newcomer dying while it receives the state"
    assert not inplace_failed(inplace, [{"rank": 2, "exitcode": 3, DURING_INPLACE: False}])
    assert not inplace_failed(None, could_not)


def _crash(node: str, rank: int, recoverable: bool = True, **more) -> dict:
    return {"node_id": node, "rank": rank, "exitcode": 1, RECOVERABLE: recoverable, **more}


def test_a_recoverable_crash_keeps_the_other_nodes_and_restarts_the_crashed_one_as_a_newcomer():
    prev, same = _topo("ABC"), _topo("ABC", 1).members
    rows = [_crash("B", 1)]
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("AC"), rows) == ("A", "C")
    two = [_crash("B", 1), _crash("C", 2)]
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("A"), two) == ("A",)


def test_a_crashed_node_sitting_the_round_out_leaves_the_others_to_reform_at_the_smaller_size():
    prev, without_b = _topo("ABC"), (_member("A", 0), _member("C", 1))
    assert plan_inplace(prev, without_b, RescaleType.SCALE_DOWN, True, _nodes("AC"), [_crash("B", 1)]) == ("A", "C")
    assert plan_inplace(prev, without_b, RescaleType.SCALE_DOWN, True, _nodes("AC"), [_crash("B", 1, False)]) == ()


def test_a_crash_takes_the_restart_path_unless_every_condition_holds():
    prev, same = _topo("ABC"), _topo("ABC", 1).members
    ok = [_crash("B", 1)]
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("AC"), []) == (), "no rows: cannot tell"
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("AC"), ok + [_crash("C", 2, False)]) == (), \
        "one failure not recoverable (a hang, a crash inside a re-form, a node without opt-in)"
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("A"), ok) == (), "survivor C not opted in"
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("BC"), [_crash("A", 0)]) == (), \
        "rank 0 crashed: no survivor holds rank 0 to send the state from"
    assert plan_inplace(prev, same, RescaleType.RESTART, True, _nodes("AC"), [{"rank": 1, RECOVERABLE: True}]) \
        == (), "a row without its node"
    lost = (_member("A", 0), _member("B", 1))
    assert plan_inplace(prev, lost, RescaleType.SCALE_DOWN, True, _nodes("AB"), ok) == (), "a crash and a lost node"
    assert plan_inplace(prev, same, RescaleType.RESTART, False, _nodes("ABC"), ok) == (), "no failure flag"


def test_a_survivor_keeps_its_workers_only_for_recoverable_crashes_of_other_nodes():
    assert keeps_through_failure([_crash("B", 1)], "A")
    assert not keeps_through_failure([_crash("B", 1)], "B"), "our own worker failed"
    assert not keeps_through_failure([_crash("B", 1), _crash("C", 2, False)], "A")
    assert not keeps_through_failure([], "A"), "the rows are not readable yet or were lost"


def test_only_a_crash_or_a_lost_node_breaks_the_rounds_collectives():
    """What the survivors' agents tell their workers (NCCL workers abort their communicators on it)."""
    assert collectives_broke(True, None, []), "a worker failure"
    assert collectives_broke(False, "B", []), "a member whose lease expired"
    assert collectives_broke(False, "B", ["C"]), "another node's graceful leave does not cover B"
    assert not collectives_broke(False, "B", ["B"]), "a graceful leave: its workers stopped at a step boundary"
    assert not collectives_broke(False, None, []), "the end for newcomers (a join)"
