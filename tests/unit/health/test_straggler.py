"""Straggler scoring and the drain decision, on made-up readings and a made-up clock."""

from __future__ import annotations

from elasticrun.health.straggler import (
    Reading,
    StragglerAction,
    StragglerPolicy,
    StragglerTracker,
    drain_decision,
    ratios,
)

POLICY = StragglerPolicy(threshold=1.2, window_s=10.0, stale_s=5.0)


def readings(times, at):
    return [Reading(rank, f"n{rank}", t, at) for rank, t in enumerate(times)]


def test_ratio_is_against_the_median():
    assert ratios({0: 1.0, 1: 1.0, 2: 2.0}) == {0: 1.0, 1: 1.0, 2: 2.0}
    assert ratios({}) == {}
    assert ratios({0: 0.0, 1: 0.0}) == {}


def test_a_slow_rank_is_flagged_only_after_the_window_and_cleared_after_one_below():
    t = StragglerTracker(POLICY)
    a = t.observe(0, readings([0.1, 0.1, 0.2], 0.0), now=0.0)
    assert not a.nodes and a.ranks[2].ratio == 2.0 and a.ranks[2].slow_since == 0.0
    a = t.observe(0, readings([0.1, 0.1, 0.2], 9.0), now=9.0)
    assert not a.nodes
    a = t.observe(0, readings([0.1, 0.1, 0.2], 10.0), now=10.0)
    assert a.nodes == {"n2": 2.0} and a.flagged == ["n2"] and a.ranks[2].straggler
    a = t.observe(0, readings([0.1, 0.1, 0.1], 11.0), now=11.0)  # fast again: still flagged for a window
    assert a.nodes and not a.flagged
    a = t.observe(0, readings([0.1, 0.1, 0.1], 21.0), now=21.0)
    assert not a.nodes and a.cleared == ["n2"]


def test_a_dip_below_the_threshold_restarts_the_window():
    t = StragglerTracker(POLICY)
    t.observe(0, readings([0.1, 0.1, 0.2], 0.0), now=0.0)
    t.observe(0, readings([0.1, 0.1, 0.11], 6.0), now=6.0)
    a = t.observe(0, readings([0.1, 0.1, 0.2], 12.0), now=12.0)
    assert not a.nodes  # slow since 12, not since 0


def test_just_below_the_threshold_is_never_flagged():
    t = StragglerTracker(POLICY)
    for now in range(0, 60, 5):
        a = t.observe(0, readings([1.0, 1.0, 1.19], now), now=now)
    assert not a.nodes


def test_a_rank_less_than_the_floor_behind_the_median_is_never_slow():
    t = StragglerTracker(POLICY)  # 1.9 ms of compute against 1.5 ms: ratio 1.27, 0.4 ms behind (scheduler noise)
    for now in range(0, 60, 5):
        a = t.observe(0, readings([0.0015, 0.0015, 0.0019], now), now=now)
    assert not a.nodes and a.ranks[2].ratio > POLICY.threshold and a.ranks[2].slow_since is None
    t = StragglerTracker(POLICY)  # 2.8 ms against 1.5 ms: 1.3 ms behind, more than the 1 ms floor
    for now in range(0, 15, 5):
        a = t.observe(0, readings([0.0015, 0.0015, 0.0028], now), now=now)
    assert a.nodes == {"n2": a.ranks[2].ratio}


def test_stale_readings_and_a_lone_rank_are_not_judged():
    t = StragglerTracker(POLICY)
    old = [Reading(0, "n0", 0.1, 0.0), Reading(1, "n1", 0.5, -100.0)]
    for now in (0.0, 20.0):
        a = t.observe(0, [Reading(0, "n0", 0.1, now), old[1]], now=now)
        assert a.ranks == {} and not a.nodes


def test_a_new_round_starts_over():
    t = StragglerTracker(POLICY)
    t.observe(0, readings([0.1, 0.1, 0.3], 0.0), now=0.0)
    a = t.observe(0, readings([0.1, 0.1, 0.3], 10.0), now=10.0)
    assert a.nodes
    a = t.observe(1, readings([0.1, 0.1, 0.3], 11.0), now=11.0)
    assert not a.nodes and a.cleared == ["n2"]


def test_several_ranks_of_one_node_make_one_straggler_node():
    t = StragglerTracker(POLICY)
    rs = [Reading(0, "a", 0.1, 0), Reading(1, "a", 0.1, 0), Reading(2, "b", 0.1, 0), Reading(3, "b", 0.4, 0)]
    t.observe(0, rs, now=0.0)
    a = t.observe(0, [Reading(r.rank, r.node, r.compute_s, 10.0) for r in rs], now=10.0)
    assert a.nodes == {"b": 4.0}


def _flagged(nodes):
    t = StragglerTracker(POLICY)
    times = [0.5 if f"n{i}" in nodes else 0.1 for i in range(len(nodes) + 3)]
    t.observe(0, readings(times, 0.0), now=0.0)
    return t.observe(0, readings(times, 10.0), now=10.0)


def test_drain_takes_the_slowest_straggler_one_at_a_time_and_never_below_min():
    a = _flagged({"n1"})
    members = ["n0", "n1", "n2", "n3"]
    assert drain_decision(a, StragglerAction.WARN, members, 1).node is None
    d = drain_decision(a, StragglerAction.DRAIN, members, 1)
    assert d.node == "n1" and "median" in d.reason
    assert drain_decision(a, StragglerAction.DRAIN, members, 4).node is None
    assert "below the minimum" in drain_decision(a, StragglerAction.DRAIN, members, 4).reason
    assert drain_decision(a, StragglerAction.DRAIN, members, 1, draining=["n1"]).node is None


def test_drain_refuses_when_half_the_nodes_are_slow():
    t = StragglerTracker(POLICY)
    times = [0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.1]
    t.observe(0, readings(times, 0.0), now=0.0)
    a = t.observe(0, readings(times, 10.0), now=10.0)
    members = ["n0", "n3", "n4", "n5"]
    d = drain_decision(a, StragglerAction.DRAIN, members, 1)
    assert d.node is None and "job-wide" in d.reason
