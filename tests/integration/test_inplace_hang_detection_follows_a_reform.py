"""Hang detection and the progress reports follow an in-place re-form, and its join window.

Real agents, a real etcd, real gloo workers (tests/scripts/inplace_worker.py, reporting with
``et.heartbeat``). A and B train; B leaves gracefully and A re-forms in place alone (world 1). A's
progress key then names the new round (``elasticrun status``, the step gauge, goodput), and when
A's worker stops advancing, its agent's ``--hang-timeout`` sees it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elasticrun.job.keys import JobKeys

from helpers.inplace import inplace_args, log_steps
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
HANG_TIMEOUT = 3


def test_a_survivor_reports_the_new_round_and_its_hang_is_detected(etcd_server, etcd, job_id, agents, tmp_path):
    log, hang = tmp_path / "steps.jsonl", tmp_path / "hang"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "4000", "INPLACE_PACE": "0.05", "INPLACE_HEARTBEAT": "1",
           "INPLACE_HANG_FILE": str(hang)}
    keys = JobKeys(job_id)
    flags = ["--hang-timeout", str(HANG_TIMEOUT)]
    a = {n: agents(inplace_args(etcd_server.endpoint, job_id, n, "1:2", extra=flags), name=n, env=env) for n in "AB"}
    wait_until(lambda: sum(r["world"] == 2 for r in log_steps(log)) >= 4, 150, "steps at world size 2")
    first = etcd.get_json(keys.topology)  # A is rank 0 or 1: whichever registered first is rank 0
    rank_a = next(m["rank_offset"] for m in first["members"] if m["node_id"] == "A")
    pid = [r["pid"] for r in log_steps(log) if r["rank"] == rank_a][-1]
    a["B"].signal(signal.SIGTERM)  # graceful leave: A re-forms in place at world size 1
    wait_until(lambda: sum(r["world"] == 1 for r in log_steps(log)) >= 4, 150, "steps at world size 1")
    topo = etcd.get_json(keys.topology)
    assert topo.get("inplace") == ["A"], topo
    assert {r["pid"] for r in log_steps(log) if r["world"] == 1} == {pid}, "A kept its worker"

    def reports_new_round() -> bool:
        report = etcd.get_json(keys.progress_of("A"))
        return report is not None and report["round"] == topo["round"] and report["world_size"] == 1
    wait_until(reports_new_round, 20, f"A's progress report naming round {topo['round']}")
    hang.touch()
    wait_until(lambda: "has not advanced" in a["A"].stderr(), 10 * HANG_TIMEOUT, "A's agent to see the hang")


def test_a_hang_while_newcomers_start_is_detected(etcd_server, etcd, job_id, agents, tmp_path):
    """The survivors train on in the old round while a newcomer starts (here: it never gets ready).
    A hang then is one: the survivor's agent, already at the new round, judges its old-round reports."""
    log, hang, gate = tmp_path / "steps.jsonl", tmp_path / "hang", tmp_path / "gate"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "4000", "INPLACE_PACE": "0.05", "INPLACE_HEARTBEAT": "1",
           "INPLACE_HANG_FILE": str(hang)}
    flags = ["--hang-timeout", str(HANG_TIMEOUT)]
    a = {n: agents(inplace_args(etcd_server.endpoint, job_id, n, extra=flags), name=n, env=env) for n in "AB"}
    wait_until(lambda: sum(r["world"] == 2 for r in log_steps(log)) >= 4, 150, "steps at world size 2")
    a["C"] = agents(inplace_args(etcd_server.endpoint, job_id, "C", extra=flags), name="C",
                    env={**env, "INPLACE_START_GATE": str(gate)})  # the gate never opens: C never gets ready
    wait_until(lambda: Path(f"{gate}.waiting").exists(), 150, "C's worker started, waiting at the gate")
    assert sorted(etcd.get_json(JobKeys(job_id).topology).get("inplace", [])) == ["A", "B"]
    hang.touch()  # A's and B's workers stop advancing in round 0 while round 1 waits for C
    wait_until(lambda: any("has not advanced" in a[n].stderr() for n in "AB"), 10 * HANG_TIMEOUT,
               "a survivor's agent to see the hang")
