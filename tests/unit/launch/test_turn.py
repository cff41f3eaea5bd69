"""The round loop's decisions (elasticrun.launch.turn): each branch of a turn, no process, no etcd."""

from __future__ import annotations

import pytest

from elasticrun.launch.turn import (
    BUSY_TURN_S,
    MIN_TURN_S,
    TURN_S,
    Fenced,
    Hung,
    InPlaceFailed,
    JobSucceeded,
    KeepRunning,
    ReportSucceeded,
    RoundChanged,
    RoundSeen,
    Stall,
    WorkerFailed,
    WorkersEnd,
    WorkersSeen,
    decide_round,
    decide_workers,
    needs_failure_rows,
    wait_before_next_turn,
)
from elasticrun.launch.workers import GroupState
from elasticrun.rendezvous.states import RoundOutcome

RUNNING, FAILED, SUCCEEDED, IDLE = GroupState.RUNNING, GroupState.FAILED, GroupState.SUCCEEDED, GroupState.IDLE
HUNG = Stall(step=41, stalled_for=16.0, timeout=16.0)
ADVANCING = Stall(step=41, stalled_for=3.0, timeout=16.0)
HALF_STALLED = Stall(step=41, stalled_for=9.0, timeout=16.0)  # at least half the timeout: a hang may hold it
HANG_ROWS = ({"signal": "hung"}, {"signal": "waiting"})
CRASH_ROWS = ({"signal": None, "exitcode": 1},)


def seen(**changes) -> WorkersSeen:
    base = dict(fenced=False, workers=RUNNING, inplace_failed=None, stall=None, done_reported=False)
    base.update(changes)
    return WorkersSeen(**base)


# -- our node -----------------------------------------------------------------------------------


def test_running_workers_with_nothing_to_say_leave_the_turn_to_the_job() -> None:
    assert decide_workers(seen()) is None
    assert decide_workers(seen(stall=ADVANCING)) is None
    assert decide_workers(seen(workers=SUCCEEDED, done_reported=True)) is None


def test_a_lost_lease_comes_first() -> None:
    assert decide_workers(seen(fenced=True, workers=IDLE)) == Fenced()
    assert decide_workers(seen(fenced=True, workers=FAILED, stall=HUNG)) == Fenced()


def test_a_failed_worker_beats_a_reform_failure_and_a_hang() -> None:
    assert decide_workers(seen(workers=FAILED)) == WorkerFailed()
    assert decide_workers(seen(workers=FAILED, inplace_failed="late", stall=HUNG)) == WorkerFailed()


def test_a_failed_reform_beats_a_hang() -> None:
    assert decide_workers(seen(inplace_failed="newcomers b not ready within 300 s", stall=HUNG)) == \
        InPlaceFailed("newcomers b not ready within 300 s")


def test_a_hang_once_the_step_stood_still_for_the_whole_timeout() -> None:
    assert decide_workers(seen(stall=HUNG)) == Hung(HUNG)
    assert decide_workers(seen(stall=Stall(41, 15.9, 16.0))) is None


@pytest.mark.parametrize("state", [SUCCEEDED, IDLE])
def test_hang_and_reform_are_judged_only_while_the_workers_run(state: GroupState) -> None:
    action = decide_workers(seen(workers=state, stall=HUNG, inplace_failed="late", done_reported=True))
    assert action is None


def test_our_success_is_reported_once() -> None:
    assert decide_workers(seen(workers=SUCCEEDED)) == ReportSucceeded()
    assert decide_workers(seen(workers=SUCCEEDED, done_reported=True)) is None


# -- the job --------------------------------------------------------------------------------------


def test_a_running_round_keeps_running() -> None:
    assert decide_round(RoundSeen(None)) == KeepRunning()


def test_every_member_finished_ends_the_job() -> None:
    assert decide_round(RoundSeen(RoundOutcome.SUCCEEDED)) == JobSucceeded()


def test_a_round_change_stops_our_workers_gracefully_or_keeps_them_in_place() -> None:
    why = "scale-up: 1 node(s) joined (b)"
    assert decide_round(RoundSeen(why)) == RoundChanged(why, WorkersEnd.GRACEFUL)
    assert decide_round(RoundSeen(why, can_keep=True)) == RoundChanged(why, WorkersEnd.KEEP)


def test_workers_stuck_in_another_nodes_hang_are_killed_at_once_and_reported() -> None:
    why = "worker failure on b"
    action = decide_round(RoundSeen(why, HALF_STALLED, HANG_ROWS, can_keep=True))
    assert action == RoundChanged(why, WorkersEnd.KILL, stuck=HALF_STALLED), "never kept, never a grace"


def test_a_planned_end_during_a_stalled_step_keeps_the_grace() -> None:
    why = "scale-up: 1 node(s) joined (b)"
    assert decide_round(RoundSeen(why, HALF_STALLED, ())) == RoundChanged(why, WorkersEnd.GRACEFUL)
    assert decide_round(RoundSeen(why, HALF_STALLED, (), can_keep=True)) == RoundChanged(why, WorkersEnd.KEEP)


def test_another_nodes_crash_or_our_advancing_step_keeps_the_grace() -> None:
    why = "worker failure on b"
    assert decide_round(RoundSeen(why, HALF_STALLED, CRASH_ROWS)).end is WorkersEnd.GRACEFUL
    assert decide_round(RoundSeen(why, ADVANCING, HANG_ROWS)).end is WorkersEnd.GRACEFUL
    assert decide_round(RoundSeen(why, None, HANG_ROWS)).end is WorkersEnd.GRACEFUL, "no hang watch"


def test_the_failure_rows_are_read_only_once_our_step_stood_still_for_half_the_timeout() -> None:
    assert not needs_failure_rows(None)
    assert not needs_failure_rows(ADVANCING)
    assert needs_failure_rows(HALF_STALLED) and needs_failure_rows(HUNG)


# -- the wait between turns -----------------------------------------------------------------------


def test_the_wait_is_short_while_a_reform_is_under_way() -> None:
    assert wait_before_next_turn(None, busy=True) == BUSY_TURN_S
    assert wait_before_next_turn(0.3, busy=True) == BUSY_TURN_S


def test_the_wait_ends_when_a_scale_up_window_closes() -> None:
    assert wait_before_next_turn(None, busy=False) == TURN_S
    assert wait_before_next_turn(0.2, busy=False) == 0.2
    assert wait_before_next_turn(7.0, busy=False) == TURN_S
    assert wait_before_next_turn(0.0, busy=False) == MIN_TURN_S
