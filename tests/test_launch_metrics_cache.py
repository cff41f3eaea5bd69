"""The /metrics render cache (a scrape storm shares one render) and hang time as badput (cause ``hang``)."""

from __future__ import annotations

import pytest

from elasticrun.launch.goodput import Cause, Goodput, Phase
from elasticrun.launch.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_scrapes_within_the_cache_time_share_one_render_per_format():
    calls = []
    m = Metrics("job1", "n1", lambda: calls.append(1) or {"world_size": len(calls)})
    c = Clock()
    m.app.clock = c
    _, first = m.app.render("")
    for _ in range(20):
        assert m.app.render("")[1] == first
    ctype, om = m.app.render("application/openmetrics-text")
    assert "openmetrics" in ctype and om.rstrip().endswith(b"# EOF")
    assert m.app.renders == 2 and len(calls) == 2
    c.t += m.app.ttl
    _, later = m.app.render("")
    assert m.app.renders == 3 and b"elasticrun_world_size" in later and later != first


def test_a_hang_charges_the_stalled_training_and_the_restart_to_hang():
    """2 s start-up, training to step 10 (1 s), 3 s stalled at step 10, hang fires, 2 s restart."""
    c = Clock()
    g = Goodput(clock=c)
    c.t += 1.0
    g.enter(Phase.STARTING)
    c.t += 1.0
    g.report(0)
    c.t += 1.0
    g.report(10)
    c.t += 3.0  # no step: the workers are stuck in a collective
    g.hang()
    c.t += 2.0  # stop, re-form, start
    g.enter(Phase.STARTING)
    c.t += 0.5
    g.report(10)
    assert g.badput[Cause.HANG] == pytest.approx(5.5)
    assert g.badput[Cause.RESTART] == 0.0 and g.badput[Cause.STARTUP] == pytest.approx(2.0)
    assert g.goodput_s == pytest.approx(1.0)
    assert g.goodput_s + sum(g.badput.values()) == pytest.approx(g.wall_s)
    assert sum(g.phase_seconds.values()) == pytest.approx(g.wall_s)
