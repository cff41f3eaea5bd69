"""In-place re-forming in the round record and the job's settings (the leader's rule, plan_inplace, is
tested in tests/unit/rendezvous/test_inplace.py)."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job.inplace import READY_WAIT_S
from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig
from elasticrun.rendezvous.records import Member, Topology
from elasticrun.rendezvous.settings import describe_mismatch


def _member(nid: str, rank: int) -> Member:
    return Member(nid, "h", "127.0.0.1", 1, rank, rank, lease=ord(nid))


def _topo(ids: str, round_: int = 0) -> Topology:
    return Topology(round_, tuple(_member(n, i) for i, n in enumerate(ids)), "127.0.0.1", 1)


def test_round_record_carries_the_inplace_members():
    topo = Topology(3, (_member("A", 0),), "127.0.0.1", 1, inplace=("A",))
    assert Topology.from_dict(topo.to_dict()).inplace == ("A",)
    assert "inplace" not in _topo("A").to_dict(), "absent when nothing re-forms in place"


def test_inplace_ready_timeout_is_a_job_setting_and_validated():
    a = LaunchConfig(workers=WorkersConfig(entrypoint="t.py")).job_settings()
    b = LaunchConfig(rendezvous=RendezvousConfig(inplace_ready_timeout=900),
                     workers=WorkersConfig(entrypoint="t.py")).job_settings()
    assert a["inplace_ready_timeout"] == READY_WAIT_S and "inplace_ready_timeout: job has 300.0" in (
        describe_mismatch(a, b) or ""), "every agent (any may lead) must judge a failed re-form alike"
    with pytest.raises(ConfigError, match="--inplace-ready-timeout 0"):
        LaunchConfig(rendezvous=RendezvousConfig(standalone=True, inplace_ready_timeout=0),
                     workers=WorkersConfig(entrypoint=__file__)).validate()
