"""The agent's side of in-place re-forming, decided without files or etcd (launch/inplace.inplace_steps,
failure_flags)."""

from __future__ import annotations

from elasticrun.job.inplace import DURING_INPLACE, EXIT_INPLACE_FAILED, RECOVERABLE
from elasticrun.launch.inplace import (
    FINISH_FIRST_S,
    InPlaceSeen,
    InPlaceState,
    InPlaceStep,
    failure_flags,
    finish_first,
    inplace_steps,
)

IDLE = InPlaceState(told=False, joining=-1, reforming=-1, published=False, deadline=0.0)
NOTHING = InPlaceSeen(opted_in=False, joined=False, newcomers_ready=False, reformed=False, now=50.0)


def state(**changes) -> InPlaceState:
    return InPlaceState(**{**IDLE.__dict__, **changes})


def seen(**changes) -> InPlaceSeen:
    return InPlaceSeen(**{**NOTHING.__dict__, **changes})


def test_nothing_to_do() -> None:
    assert inplace_steps(IDLE, NOTHING) == []


def test_opt_in_is_published_once_and_not_while_busy() -> None:
    assert inplace_steps(IDLE, seen(opted_in=True)) == [InPlaceStep.PUBLISH_OPTIN]
    assert inplace_steps(state(told=True), seen(opted_in=True)) == []
    assert inplace_steps(state(joining=4, deadline=100.0), seen(opted_in=True)) == []
    assert inplace_steps(state(reforming=4, deadline=100.0), seen(opted_in=True)) == []


def test_a_newcomer_marks_itself_ready_or_gives_up_after_its_deadline() -> None:
    joining = state(joining=4, deadline=100.0)
    assert inplace_steps(joining, seen(joined=True)) == [InPlaceStep.MARK_JOINED]
    assert inplace_steps(joining, seen(joined=True, now=200.0)) == [InPlaceStep.MARK_JOINED], "ready wins"
    assert inplace_steps(joining, seen(now=100.0)) == []
    assert inplace_steps(joining, seen(now=100.1)) == [InPlaceStep.STOP_JOINING]


def test_a_survivor_publishes_the_assignments_once_every_newcomer_is_ready() -> None:
    waiting = state(told=True, reforming=4, deadline=100.0)
    assert inplace_steps(waiting, seen()) == []
    assert inplace_steps(waiting, seen(newcomers_ready=True)) == [InPlaceStep.PUBLISH_ASSIGNMENTS]
    assert inplace_steps(waiting, seen(newcomers_ready=True, now=200.0)) == [InPlaceStep.PUBLISH_ASSIGNMENTS]


def test_newcomers_late_fail_the_reform() -> None:
    waiting = state(told=True, reforming=4, deadline=100.0)
    assert inplace_steps(waiting, seen(now=100.1)) == [InPlaceStep.NEWCOMERS_LATE]


def test_a_published_reform_ends_when_every_worker_formed_or_fails_after_the_deadline() -> None:
    published = state(told=True, reforming=4, published=True, deadline=160.0)
    assert inplace_steps(published, seen(now=150.0)) == []
    assert inplace_steps(published, seen(reformed=True, now=150.0)) == [InPlaceStep.REFORMED]
    assert inplace_steps(published, seen(reformed=True, now=170.0)) == [InPlaceStep.REFORMED], "formed wins"
    assert inplace_steps(published, seen(now=160.1)) == [InPlaceStep.REFORM_LATE]
    assert inplace_steps(published, seen(newcomers_ready=True, now=150.0)) == [], "assignments written once"


def test_a_crash_of_opted_in_workers_outside_a_reform_is_recoverable_in_place() -> None:
    assert failure_flags(False, True, 1) == {RECOVERABLE: True}
    assert failure_flags(False, True, -9) == {RECOVERABLE: True}, "SIGKILL"
    assert failure_flags(False, True, EXIT_INPLACE_FAILED) == {RECOVERABLE: False}, "could not re-form itself"
    assert failure_flags(False, False, 1) == {}, "not opted in (or a re-form under way): the restart path"
    assert failure_flags(True, True, 1) == {DURING_INPLACE: True}, "inside a re-form: a failed re-form"


def test_an_end_for_newcomers_waits_for_a_reform_under_way_for_a_bounded_time() -> None:
    """A crashed node rejoins while the survivors still re-form without it: they finish first, then are kept."""
    assert finish_first(True, 0.0, lambda: True)
    assert not finish_first(True, FINISH_FIRST_S, lambda: True), "past the bound: the restart path"
    assert not finish_first(True, 0.0, lambda: False), "a lost member or a failure: act at once"
    asked = []
    assert not finish_first(False, 0.0, lambda: asked.append(1) or True) and not asked, "nothing under way: no read"
