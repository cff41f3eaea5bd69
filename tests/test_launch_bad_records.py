"""Malformed records written into a live job's prefix (by another version, a foreign client or by hand)
never crash the agent: each is reported once (which key, what is wrong) and ignored, and the job ends
with its real outcome and exit code. Real etcd, real agents and workers (the echo worker)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict

import pytest

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.jobstatus import JobNotFoundError, job_status
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer

from helpers.launch import ECHO
from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

NOTICE = "ignoring a malformed record in etcd at "


def _running(etcd: EtcdStore, job: str) -> bool:
    try:
        doc = job_status(etcd, job, leases=False)
    except JobNotFoundError:
        return False
    return bool(doc["members"]) and all(m["status"] == "Active" for m in doc["members"])


def _garbage(keys: JobKeys, node: str) -> Dict[str, bytes]:
    """One malformed record per kind the agent reads while a round runs."""
    return {
        keys.state: json.dumps({"state": 5}).encode(),  # old code: the job "ended" (failed, exit 1)
        keys.failed(0): b"[1, 2]",  # a failure flag that is a list: no worker failed
        keys.end(0): b"{truncated",
        keys.node("zz"): json.dumps({"node_id": "zz", "nproc": "many"}).encode(),
        keys.progress_of(node): json.dumps({"step": "x", "round": 0}).encode(),  # old code: observer traceback
        keys.event(7): b"\xff\xfe",
        keys.restarts: json.dumps(["not", "times"]).encode(),
        keys.failure(0, "zz"): json.dumps([1, 2]).encode(),  # old code: root_cause crashed on it
        keys.goodput_of("zz"): json.dumps({"wall_s": "long"}).encode(),
    }


def _start(agents: Callable[..., Agent], endpoint: str, job: str, env: Dict[str, str]) -> Agent:
    return agents(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
                   "--node-id", "a", "--max-restarts", "0", "--heartbeat-timeout", "3", "--standby", "0",
                   "--no-prewarm", ECHO], env=env)


def test_malformed_records_in_a_live_job_are_reported_once_and_the_job_succeeds(
        agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, tmp_path: Path) -> None:
    keys = JobKeys(job_id)
    hold = tmp_path / "hold"  # the worker ends once it exists
    agent = _start(agents, etcd_server.endpoint, job_id, {"ECHO_HOLD_FILE": str(hold)})
    wait_until(lambda: _running(etcd, job_id), 90, "the job running")
    garbage = _garbage(keys, "a")
    for key, value in garbage.items():
        etcd.put(key, value)
    read = (keys.state, keys.progress_of("a"), keys.failed(0), keys.end(0))  # while the round runs
    wait_until(lambda: all(NOTICE + key + ":" in agent.stderr() for key in read), 60, "the records to be read")
    hold.touch()
    code = agent.wait(120)
    err = agent.stderr()
    assert code == 0, agent.output()[-3000:]
    assert "Traceback" not in agent.output(), err[-3000:]
    for key in read:
        assert err.count(NOTICE + key + ":") == 1, f"{key} reported {err.count(NOTICE + key + ':')} times:\n{err}"
    assert "field 'state'" in err and "field 'step'" in err
    doc = job_status(etcd, job_id)  # status shows the real end and skips what it cannot read
    assert doc["phase"] == "succeeded" and doc["state"]["state"] == "succeeded"
    assert "zz" not in doc["goodput_nodes"]


def test_malformed_records_never_change_a_failed_jobs_exit_code_or_root_cause(
        agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, tmp_path: Path) -> None:
    keys = JobKeys(job_id)
    hold = tmp_path / "hold"  # the worker fails once it exists
    agent = _start(agents, etcd_server.endpoint, job_id,
                   {"ECHO_HOLD_FILE": str(hold), "ECHO_FAIL_RANK_AT_RESTART": "0:0"})
    wait_until(lambda: _running(etcd, job_id), 90, "the job running")
    etcd.put(keys.failure(0, "zz"), json.dumps([1, 2]))
    etcd.put(keys.restarts, b"{")
    hold.touch()  # read when the failure is handled
    assert agent.wait(120) == 1, agent.output()[-3000:]
    out = agent.output()
    assert "Traceback" not in out, out[-3000:]
    assert "(root cause)" in out and "exit" in out  # the real failure's table
    assert out.count(NOTICE + keys.failure(0, "zz") + ":") == 1, out[-3000:]
    assert job_status(etcd, job_id)["phase"] == "failed"
