"""Who re-forms in place: the leader's rule (elasticrun.rendezvous.inplace.plan_inplace) and the round record."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job.keys import JobKeys
from elasticrun.job.reform import EXIT_REFORM_FAILED, IN_REFORM, READY_WAIT_S
from elasticrun.launch.config import LaunchConfig
from elasticrun.rendezvous.inplace import plan_inplace, reform_caused, reform_failed
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology
from elasticrun.rendezvous.settings import describe_mismatch


def _member(nid: str, rank: int) -> Member:
    return Member(nid, "h", "127.0.0.1", 1, rank, rank, lease=ord(nid))


def _topo(ids: str, round_: int = 0) -> Topology:
    return Topology(round_, tuple(_member(n, i) for i, n in enumerate(ids)), "127.0.0.1", 1)


def _nodes(opted: str, ids: str = "ABC"):
    return {n: (NodeInfo(n, "h", "127.0.0.1", 1, 1, inplace=n in opted), ord(n)) for n in ids}


def test_join_reforms_survivors_only_when_all_opted_in(store):
    keys = JobKeys("j")
    prev, new = _topo("AB"), _topo("ABC", 1).members
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, False, _nodes("AB"), store, keys) == ("A", "B")
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, False, _nodes("A"), store, keys) == ()
    assert plan_inplace(prev, new, RescaleType.SCALE_UP, True, _nodes("AB"), store, keys) == (), "a failure restarts"
    assert plan_inplace(prev, new, RescaleType.RESTART, False, _nodes("AB"), store, keys) == ()
    assert plan_inplace(None, new, RescaleType.START, False, _nodes("ABC"), store, keys) == ()


def test_leave_reforms_only_when_graceful(store):
    keys = JobKeys("j")
    prev, new = _topo("ABC"), (_member("A", 0), _member("C", 1))
    assert plan_inplace(prev, new, RescaleType.SCALE_DOWN, False, _nodes("AC"), store, keys) == (), "lost, not left"
    store.put_json(keys.left(0, "B"), {"time": 0})
    assert plan_inplace(prev, new, RescaleType.SCALE_DOWN, False, _nodes("AC"), store, keys) == ("A", "C")


def test_round_record_carries_the_inplace_members():
    topo = Topology(3, (_member("A", 0),), "127.0.0.1", 1, inplace=("A",))
    assert Topology.from_dict(topo.to_dict()).inplace == ("A",)
    assert "inplace" not in _topo("A").to_dict(), "absent when nothing re-forms in place"


def test_only_a_failed_reform_of_an_inplace_round_is_free(store):
    """The restart after a failed in-place re-form is not charged; a crash in an ordinary round, or
    after the re-form (however soon), is."""
    keys = JobKeys("j")
    members = (_member("A", 0), _member("B", 1))
    inplace = Topology(4, members, "127.0.0.1", 1, created_at=1000.0, inplace=("A",))
    ordinary = Topology(4, members, "127.0.0.1", 1, created_at=1000.0)
    assert not reform_failed(inplace, store, keys), "no failure recorded"
    store.put_json(keys.failed(4), {"node": "B", "rank": 1, "time": 1000.0 + 5})
    store.put_json(keys.failure(4, "B"), [{"rank": 1, "exitcode": 1}])
    assert not reform_failed(inplace, store, keys), "a crash 5 s after the round formed, not in its re-form"
    store.put_json(keys.failure(4, "A"), [{"rank": 0, "exitcode": EXIT_REFORM_FAILED}])
    assert reform_failed(inplace, store, keys), "a worker that could not re-form"
    assert not reform_failed(ordinary, store, keys), "exit 75 outside an in-place round is a plain failure"
    store.delete(keys.failure(4, "A"))
    store.put_json(keys.failure(4, "C"), [{"rank": 2, "exitcode": 3, IN_REFORM: True}])
    assert reform_failed(inplace, store, keys), "a newcomer dying while it receives the state"
    assert not reform_failed(None, store, keys)


def test_reform_caused_reads_the_rows_alone():
    assert not reform_caused([])
    assert not reform_caused([{"exitcode": 1}, {"exitcode": -9, IN_REFORM: False}])
    assert reform_caused([{"exitcode": 1}, {"exitcode": EXIT_REFORM_FAILED}])
    assert reform_caused([{"exitcode": 4, IN_REFORM: True}])


def test_inplace_ready_timeout_is_a_job_setting_and_validated():
    a = LaunchConfig(entrypoint="t.py").job_settings()
    b = LaunchConfig(entrypoint="t.py", inplace_ready_timeout=900).job_settings()
    assert a["inplace_ready_timeout"] == READY_WAIT_S and "inplace_ready_timeout: job has 300.0" in (
        describe_mismatch(a, b) or ""), "every agent (any may lead) must judge a failed re-form alike"
    with pytest.raises(ConfigError, match="--inplace-ready-timeout 0"):
        LaunchConfig(entrypoint=__file__, standalone=True, inplace_ready_timeout=0).validate()
