"""Pure parts of the round protocol: rank planning, event classification, configuration checks."""

from __future__ import annotations

import dataclasses

import pytest

from elasticrun.errors import ConfigError
from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig, parse_nnodes, parse_nproc
from elasticrun.rendezvous.ranks import assign_ranks, classify, plan_members
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology
from elasticrun.rendezvous.settings import describe_mismatch


def node(nid: str, nproc: int = 1, t: float = 0.0) -> NodeInfo:
    return NodeInfo(node_id=nid, host="h", addr="127.0.0.1", nproc=nproc, pid=1, registered_at=t)


def topo(members) -> Topology:
    return Topology(round=0, members=tuple(members), master_addr="127.0.0.1", master_port=1)


def test_ranks_by_prefix_sum_for_heterogeneous_nodes():
    members = assign_ranks([(node("a", 2), 1), (node("b", 3), 2), (node("c", 1), 3)])
    assert [(m.group_rank, m.rank_offset, m.nproc) for m in members] == [(0, 0, 2), (1, 2, 3), (2, 5, 1)]
    assert list(members[1].ranks) == [2, 3, 4]
    assert topo(members).world_size == 6


def test_survivors_keep_order_newcomers_after_them():
    prev = topo(assign_ranks([(node("z"), 1), (node("a"), 2), (node("m"), 3)]))
    cands = [(node("new2", t=5.0), 9), (node("m"), 3), (node("new1", t=1.0), 8), (node("z"), 1)]
    members, spares = plan_members(prev, cands, max_nodes=3)
    assert [m.node_id for m in members] == ["z", "m", "new1"]
    assert spares == ["new2"]


def test_rejoined_node_with_new_lease_is_a_newcomer():
    prev = topo(assign_ranks([(node("a"), 1), (node("b"), 2)]))
    members, _ = plan_members(prev, [(node("b", t=9.0), 7), (node("a"), 1)], max_nodes=4)
    assert [m.node_id for m in members] == ["a", "b"]
    assert classify(prev, members, failed=False) == RescaleType.REPLACE


@pytest.mark.parametrize(
    "new, failed, kind",
    [
        (["a", "b"], True, RescaleType.RESTART),
        (["a"], False, RescaleType.SCALE_DOWN),
        (["a", "b", "c"], False, RescaleType.SCALE_UP),
        (["a", "c"], False, RescaleType.REPLACE),
    ],
)
def test_classify(new, failed, kind):
    leases = {"a": 1, "b": 2, "c": 3}
    prev = topo(assign_ranks([(node("a"), 1), (node("b"), 2)]))
    members = assign_ranks([(node(n), leases[n]) for n in new])
    assert classify(prev, members, failed) == kind
    assert classify(None, members, failed) == RescaleType.START


def test_topology_round_trips_through_json():
    t = topo(assign_ranks([(node("a", 2), 11), (node("b"), 12)]))
    again = Topology.from_dict(t.to_dict())
    assert again == t and again.member("b") == Member("b", "h", "127.0.0.1", 1, 1, 2, 12)


def test_nnodes_and_nproc_parsing():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad, msg in (("3:2", "larger than MAX"), ("0", "at least 1"), ("x", "not N or MIN:MAX")):
        with pytest.raises(ConfigError, match=msg):
            parse_nnodes(bad)
    assert parse_nproc("3") == (3, "auto")
    assert parse_nproc("cpu")[0] >= 1
    with pytest.raises(ConfigError, match="at least 1"):
        parse_nproc("0")


def test_config_validation_messages(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    ok = LaunchConfig(rendezvous=RendezvousConfig(rdzv_endpoint="127.0.0.1:2379"),
                      workers=WorkersConfig(entrypoint=str(script)))
    assert ok.validate() is ok
    cases = [
        ({"rendezvous.rdzv_endpoint": ""}, "--standalone"),
        ({"workers.entrypoint": str(tmp_path / "nope.py")}, "not found"),
        ({"rendezvous.heartbeat_timeout": 1}, "at least 2 seconds"),
        ({"rendezvous.rdzv_id": "bad id!"}, "--rdzv-id"),
        ({"logs.redirects": "9"}, "--redirects"),
        ({"rendezvous.max_restarts": -1}, "--max-restarts"),
    ]
    for changes, msg in cases:
        cfg = LaunchConfig.of({"rendezvous.rdzv_endpoint": "127.0.0.1:2379", "workers.entrypoint": str(script),
                               **changes})
        with pytest.raises(ConfigError, match=msg):
            cfg.validate()


def test_job_settings_mismatch_is_described():
    a = LaunchConfig(workers=WorkersConfig(entrypoint="t.py", nproc_per_node=2)).job_settings()
    b = LaunchConfig(workers=WorkersConfig(entrypoint="t.py", nproc_per_node=3)).job_settings()
    assert "nproc_per_node: job has 2, this node has 3" in describe_mismatch(a, b)
    assert describe_mismatch(a, dict(a)) is None
    het = LaunchConfig(rendezvous=RendezvousConfig(heterogeneous=True),
                       workers=WorkersConfig(entrypoint="t.py", nproc_per_node=3)).job_settings()
    assert "nproc_per_node" not in het


def test_member_to_dict_has_every_field_and_round_trips():
    m = Member("node-a", "host", "10.0.0.1", 4, 2, 8, lease=77)
    assert m.to_dict() == dataclasses.asdict(m)  # a new field must be added to to_dict too
    assert Member.from_dict(m.to_dict()) == m
