"""--node-check's admission (launch/nodecheck.py) with a made-up report and an in-memory store."""

from __future__ import annotations

import pytest

from elasticrun.health.node import NodeReport
from elasticrun.health.verdict import at_least
from elasticrun.job import records
from elasticrun.job.exitcodes import ExitCode, for_error
from elasticrun.job.keys import JobKeys
from elasticrun.launch import nodecheck
from elasticrun.launch.config import HealthConfig, LaunchConfig, RendezvousConfig, WorkersConfig

K = JobKeys("j")


def cfg(node_check: bool) -> LaunchConfig:
    return LaunchConfig(rendezvous=RendezvousConfig(rdzv_id="j", node_id="n1", rdzv_endpoint="127.0.0.1:1"),
                        workers=WorkersConfig(entrypoint="x.py"),
                        health=HealthConfig(node_check=node_check))


def test_a_failing_node_is_excluded_with_the_reason_and_exits_6(store, monkeypatch):
    bad = NodeReport([at_least("cpu matmul (1 thread)", 0.5, 2.0, "GFLOP/s")])
    monkeypatch.setattr(nodecheck, "run_check", lambda plan: bad)
    said, seen = [], []
    with pytest.raises(nodecheck.NodeExcluded) as err:
        nodecheck.admit(cfg(True), store, said.append, seen.append)
    assert for_error(err.value) == ExitCode.NODE_UNHEALTHY == 6
    assert seen == [bad] and any("cpu matmul" in line for line in said)
    rec = records.read(store.get(K.excluded_of("n1")), records.excluded_record)
    assert rec["why"] == "node-check" and "0.5 GFLOP/s is below 2" in rec["reason"]
    assert rec["checks"][0]["verdict"] == "fail"


def test_a_node_that_joins_removes_its_old_exclusion(store, monkeypatch):
    store.put_json(K.excluded_of("n1"), {"reason": "drained", "why": "straggler"})
    monkeypatch.setattr(nodecheck, "run_check", lambda plan: pytest.fail("no check without --node-check"))
    assert nodecheck.admit(cfg(False), store, print, print) is None
    assert store.get(K.excluded_of("n1")) is None
    good = NodeReport([at_least("cpu matmul (1 thread)", 9.0, 2.0, "GFLOP/s")])
    store.put_json(K.excluded_of("n1"), {"reason": "old", "why": "node-check"})
    monkeypatch.setattr(nodecheck, "run_check", lambda plan: good)
    assert nodecheck.admit(cfg(True), store, print, print) is good
    assert store.get(K.excluded_of("n1")) is None


def test_the_plan_checks_etcd_only_outside_the_job():
    c = cfg(True)
    assert nodecheck.check_plan(c, None).endpoint == "127.0.0.1:1"  # type: ignore[arg-type]
    c.rendezvous.standalone = True
    assert nodecheck.check_plan(c, None).endpoint == ""  # type: ignore[arg-type]
