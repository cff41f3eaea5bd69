"""The agent's side of in-place re-forming, decided without files or etcd (launch/inplace.reform_steps)."""

from __future__ import annotations

from elasticrun.launch.inplace import ReformSeen, ReformState, ReformStep, reform_steps

IDLE = ReformState(told=False, joining=-1, reforming=-1, published=False, deadline=0.0)
NOTHING = ReformSeen(opted_in=False, joined=False, newcomers_ready=False, reformed=False, now=50.0)


def state(**changes) -> ReformState:
    return ReformState(**{**IDLE.__dict__, **changes})


def seen(**changes) -> ReformSeen:
    return ReformSeen(**{**NOTHING.__dict__, **changes})


def test_nothing_to_do() -> None:
    assert reform_steps(IDLE, NOTHING) == []


def test_opt_in_is_published_once_and_not_while_busy() -> None:
    assert reform_steps(IDLE, seen(opted_in=True)) == [ReformStep.PUBLISH_OPTIN]
    assert reform_steps(state(told=True), seen(opted_in=True)) == []
    assert reform_steps(state(joining=4, deadline=100.0), seen(opted_in=True)) == []
    assert reform_steps(state(reforming=4, deadline=100.0), seen(opted_in=True)) == []


def test_a_newcomer_marks_itself_ready_or_gives_up_after_its_deadline() -> None:
    joining = state(joining=4, deadline=100.0)
    assert reform_steps(joining, seen(joined=True)) == [ReformStep.MARK_JOINED]
    assert reform_steps(joining, seen(joined=True, now=200.0)) == [ReformStep.MARK_JOINED], "ready wins"
    assert reform_steps(joining, seen(now=100.0)) == []
    assert reform_steps(joining, seen(now=100.1)) == [ReformStep.STOP_JOINING]


def test_a_survivor_publishes_the_assignments_once_every_newcomer_is_ready() -> None:
    waiting = state(told=True, reforming=4, deadline=100.0)
    assert reform_steps(waiting, seen()) == []
    assert reform_steps(waiting, seen(newcomers_ready=True)) == [ReformStep.PUBLISH_ASSIGNMENTS]
    assert reform_steps(waiting, seen(newcomers_ready=True, now=200.0)) == [ReformStep.PUBLISH_ASSIGNMENTS]


def test_newcomers_late_fail_the_reform() -> None:
    waiting = state(told=True, reforming=4, deadline=100.0)
    assert reform_steps(waiting, seen(now=100.1)) == [ReformStep.NEWCOMERS_LATE]


def test_a_published_reform_ends_when_every_worker_formed_or_fails_after_the_deadline() -> None:
    published = state(told=True, reforming=4, published=True, deadline=160.0)
    assert reform_steps(published, seen(now=150.0)) == []
    assert reform_steps(published, seen(reformed=True, now=150.0)) == [ReformStep.REFORMED]
    assert reform_steps(published, seen(reformed=True, now=170.0)) == [ReformStep.REFORMED], "formed wins"
    assert reform_steps(published, seen(now=160.1)) == [ReformStep.REFORM_LATE]
    assert reform_steps(published, seen(newcomers_ready=True, now=150.0)) == [], "assignments written once"
