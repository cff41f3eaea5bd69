"""Which files move between nodes to restore a memory generation, decided from what each node
needs and holds (no shared memory, no process group)."""

from __future__ import annotations

import pytest

from elasticrun.checkpoint.memory.fetch import plan_transfers
from elasticrun.errors import CheckpointError


def test_a_node_holding_all_it_needs_in_its_generation_loads_locally() -> None:
    have = [{"gen": ["a", "b"], "rep": []}, {"gen": ["c"], "rep": ["a", "b"]}]
    plan = plan_transfers("g", [{"a", "b"}, {"c"}], have)
    assert plan.local == [True, True] and plan.transfers == []


def test_missing_files_come_from_the_first_node_holding_them_in_order() -> None:
    # Node 1 lost its peer: it holds "b" as a replica only; the newcomer (node 2) has nothing.
    have = [{"gen": ["a"], "rep": ["c"]}, {"gen": ["c"], "rep": ["b"]}, {"gen": [], "rep": []}]
    plan = plan_transfers("g", [{"a"}, {"a", "b", "c"}, {"b", "c"}], have)
    assert plan.local == [True, False, False]
    assert plan.present == [{"a", "c"}, {"b", "c"}, set()]
    assert plan.transfers == [("a", 0, 1), ("b", 1, 2), ("c", 0, 2)]


def test_a_file_on_no_node_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"^memory snapshot 'g': b is on no node any more$"):
        plan_transfers("g", [{"a", "b"}], [{"gen": ["a"], "rep": []}])


def test_a_file_left_out_as_corrupt_names_the_node() -> None:
    have = [{"gen": ["a"], "rep": [], "corrupt": ["b"]}, {"gen": [], "rep": [], "corrupt": []}]
    with pytest.raises(CheckpointError, match="b fails its checksum on node 0 and no other node holds it"):
        plan_transfers("g", [{"a", "b"}, set()], have)
