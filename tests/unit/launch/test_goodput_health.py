"""The health causes of goodput accounting: node check, drain and straggler, on a made-up clock."""

from __future__ import annotations

import pytest

from elasticrun.launch.goodput import Cause, Goodput, Phase


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _invariant(g: Goodput) -> None:
    assert g.goodput_s + sum(g.totals()[1].values()) == pytest.approx(g.wall_s)


def test_node_check_drain_and_straggler_are_badput_causes():
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.RENDEZVOUS, Cause.NODE_CHECK)
    c.t += 20  # the check
    g.enter(Phase.RENDEZVOUS, Cause.STARTUP)
    c.t += 5
    g.enter(Phase.STARTING)
    c.t += 5
    g.report(0)
    c.t += 100  # healthy training
    g.slowed(2.0)  # the slowest rank computes 2x the median: the others wait half the time
    c.t += 100
    g.slowed(None)
    c.t += 50
    g.enter(Phase.RESCALING, Cause.DRAIN)  # the straggler's node was drained
    c.t += 10
    g.enter(Phase.STARTING)
    c.t += 4
    g.report(300)
    _, badput = g.totals()
    assert badput[Cause.NODE_CHECK] == pytest.approx(20)
    assert badput[Cause.STARTUP] == pytest.approx(10)
    assert badput[Cause.STRAGGLER] == pytest.approx(50)
    assert badput[Cause.DRAIN] == pytest.approx(14)  # re-forming and the next start-up
    assert badput[Cause.RESCALE] == 0
    assert g.goodput_s == pytest.approx(250 - 50)
    assert g.counters()["lost_s"]["straggler"] == pytest.approx(50)
    _invariant(g)


def test_a_plain_rescale_stays_rescale():
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.RESCALING, Cause.RESCALE)
    c.t += 3
    assert g.totals()[1][Cause.RESCALE] == pytest.approx(3)
