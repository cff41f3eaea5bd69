"""When a running round pre-warms the next round's standby interpreters (elasticrun.launch.standby)."""

from __future__ import annotations

from typing import List

from elasticrun.launch.standby import STANDBY_DELAY_S, Standby, prewarm_due


def test_deep_after_the_delay_torch_only_at_once_when_a_node_joins() -> None:
    assert prewarm_due(now=10.0, at=12.0, joining=False) is None
    assert prewarm_due(now=12.0, at=12.0, joining=False) is True
    assert prewarm_due(now=10.0, at=12.0, joining=True) is False
    assert prewarm_due(now=13.0, at=12.0, joining=True) is False, "a joining node wins: torch only, now"
    assert prewarm_due(now=13.0, at=None, joining=True) is None, "once per round"


def test_a_round_prewarms_once() -> None:
    calls: List[bool] = []
    standby = Standby(calls.append, started_at=100.0)
    standby.turn(100.0 + STANDBY_DELAY_S - 0.1, joining=False)
    assert calls == []
    standby.turn(100.0 + STANDBY_DELAY_S, joining=False)
    standby.turn(200.0, joining=True)
    assert calls == [True]


def test_a_joining_node_prewarms_torch_only_before_the_delay() -> None:
    calls: List[bool] = []
    standby = Standby(calls.append, started_at=100.0)
    standby.turn(100.1, joining=True)
    standby.turn(100.0 + STANDBY_DELAY_S, joining=False)
    assert calls == [False]
