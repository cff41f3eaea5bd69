"""DataRedistributionPlan: property checks over many random membership changes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from elasticrun.errors import ConfigError
from elasticrun.models import RedistributionType
from elasticrun.train import DataRedistributionPlan, Transfer, make_shards

FULL, INC = RedistributionType.FULL_RESHUFFLE, RedistributionType.INCREMENTAL


def random_change(rng: random.Random):
    n_shards = rng.randint(0, 60)
    old_nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
    balanced = rng.random() < 0.7
    if balanced:
        old = DataRedistributionPlan.build(n_shards, {}, old_nodes, FULL).assignments
    else:  # arbitrary (unbalanced, partial) old assignment
        old = {n: [] for n in old_nodes}
        for sid in range(n_shards):
            if rng.random() < 0.9:
                old[rng.choice(old_nodes)].append(sid)
    survivors = [n for n in old_nodes if rng.random() < 0.6]
    newcomers = [f"m{i}" for i in range(rng.randint(0 if survivors else 1, 4))]
    new_nodes = survivors + newcomers
    rng.shuffle(new_nodes)
    return n_shards, old, new_nodes, balanced


@pytest.mark.parametrize("kind", [FULL, INC])
def test_random_plans_are_valid(kind):
    rng = random.Random(42 if kind is FULL else 43)
    for _ in range(500):
        n_shards, old, new_nodes, _ = random_change(rng)
        plan = DataRedistributionPlan.build(n_shards, old, new_nodes, kind)
        plan.validate()
        flat = [s for v in plan.assignments.values() for s in v]
        assert Counter(flat) == Counter(range(n_shards))
        loads = [len(plan.assignments[n]) for n in new_nodes]
        assert max(loads) - min(loads) <= 1
        old_owner = {s: n for n, v in old.items() for s in v}
        moved = {s for n, v in plan.assignments.items() for s in v if old_owner.get(s) != n}
        assert {t.shard for t in plan.transfers} == moved
        for t in plan.transfers:
            assert t.priority == (0 if t.source not in new_nodes else 1)
        assert DataRedistributionPlan.from_dict(plan.to_dict()) == plan


def test_incremental_moves_only_what_it_must():
    rng = random.Random(7)
    for _ in range(500):
        n_shards, old, new_nodes, balanced = random_change(rng)
        plan = DataRedistributionPlan.build(n_shards, old, new_nodes, INC)
        full = DataRedistributionPlan.build(n_shards, old, new_nodes, FULL)
        assert plan.moved <= full.moved
        kept = {n: set(old.get(n, [])) & set(plan.assignments[n]) for n in new_nodes}
        owned_before = {s for n in new_nodes for s in old.get(n, [])}
        orphans = n_shards - len(owned_before)
        # every move is an orphan (lost node / unassigned) or a survivor's excess over its fair share
        base, extra = divmod(n_shards, len(new_nodes))
        for n in new_nodes:
            assert len(kept[n]) >= min(len(old.get(n, [])), base), "a survivor lost more than its excess"
        excess = sum(len(old.get(n, [])) - len(kept[n]) for n in new_nodes)
        assert plan.moved == orphans + excess
        if balanced and set(new_nodes) <= set(old):
            # pure scale-down from a balanced plan: survivors keep everything they had
            assert excess == 0
            assert all(t.source not in new_nodes for t in plan.transfers)


def test_scale_down_example():
    old = {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7, 8]}
    plan = DataRedistributionPlan.build(9, old, ["a", "c"], INC)
    plan.validate()
    assert plan.assignments["a"][:3] == [0, 1, 2] and plan.assignments["c"][:3] == [6, 7, 8]
    assert sorted(t.shard for t in plan.transfers) == [3, 4, 5]
    assert all(t.source == "b" and t.priority == 0 for t in plan.transfers)
    assert [t.shard for t in plan.incoming("a")] == plan.assignments["a"][3:]


def test_scale_up_example_survivors_give_excess_to_newcomer():
    old = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    plan = DataRedistributionPlan.build(8, old, ["a", "b", "c"], INC)
    plan.validate()
    assert sorted(len(v) for v in plan.assignments.values()) == [2, 3, 3]
    assert all(t.destination == "c" and t.priority == 1 for t in plan.transfers)
    assert plan.moved == 2
    assert len(plan.outgoing("a")) + len(plan.outgoing("b")) == 2


def test_full_reshuffle_is_contiguous():
    shards = make_shards(100, 7)
    assert [s.size for s in shards] == [15, 15, 14, 14, 14, 14, 14]
    assert shards[-1].stop == 100
    plan = DataRedistributionPlan.build(shards, {}, ["x", "y", "z"], FULL)
    plan.validate()
    assert plan.assignments == {"x": [0, 1, 2], "y": [3, 4], "z": [5, 6]}
    assert plan.samples_of("y", shards) == list(range(44, 72))
    assert all(t.source is None and t.priority == 0 for t in plan.transfers)


def test_build_rejects_bad_input():
    with pytest.raises(ConfigError, match="empty node list"):
        DataRedistributionPlan.build(3, {}, [])
    with pytest.raises(ConfigError, match="duplicate node"):
        DataRedistributionPlan.build(3, {}, ["a", "a"])
    with pytest.raises(ConfigError, match="shard 1 to both 'a' and 'b'"):
        DataRedistributionPlan.build(3, {"a": [0, 1], "b": [1]}, ["a"])
    with pytest.raises(ConfigError, match="shard 9, which is not in the shard list"):
        DataRedistributionPlan.build(3, {"a": [9]}, ["a"])


def test_validate_catches_broken_plans():
    good = DataRedistributionPlan.build(6, {"a": [0, 1, 2], "b": [3, 4, 5]}, ["a", "b", "c"], INC)
    good.validate()

    def broken(**changes):
        d = good.to_dict()
        d.update(changes)
        return DataRedistributionPlan.from_dict(d)

    a = good.assignments
    with pytest.raises(ConfigError, match="more than once"):
        broken(assignments={**a, "c": a["c"] + [a["a"][0]]}).validate()
    with pytest.raises(ConfigError, match="unassigned"):
        broken(assignments={**a, "a": a["a"][1:]}).validate()
    with pytest.raises(ConfigError, match="unbalanced"):
        broken(assignments={"a": [0, 1, 2, 3], "b": [4, 5], "c": []}, transfers=[]).validate()
    with pytest.raises(ConfigError, match="outside the new node list"):
        broken(assignments={**a, "zz": []}).validate()
    with pytest.raises(ConfigError, match="transfers do not match"):
        broken(transfers=[]).validate()
    t = good.transfers[0]
    wrong = Transfer(shard=t.shard, destination=t.destination, source="nobody", priority=t.priority)
    with pytest.raises(ConfigError, match="not its old owner"):
        broken(transfers=[wrong.to_dict()] + [x.to_dict() for x in good.transfers[1:]]).validate()
