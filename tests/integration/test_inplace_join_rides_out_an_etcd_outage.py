"""An etcd outage during an in-place join is ridden out like one during training.

Real agents, a real (private) etcd, real gloo workers (tests/scripts/inplace_worker.py). A and B
train; C joins and the leader writes round 1 (A and B re-form in place). etcd is stopped (SIGSTOP)
right as C's worker gets ready, so C's agent meets the outage when it writes ``ready/C``. The
write is retried within ``--etcd-outage-grace``: no agent exits, the survivors re-form in place
once etcd answers again (their worker processes kept), and the job trains at world size 3.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elasticrun.job.keys import JobKeys
from elasticrun.store.client import connect

from helpers.inplace import inplace_args, log_steps
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
HB = 12  # a lease outlives the outage (refreshed every HB/3 s): only the calls made during it fail
OUTAGE_S = 7.0  # longer than a call's deadline (5 s) plus --etcd-timeout: a call made during it fails
GUARD = ["--etcd-timeout", "1", "--etcd-outage-grace", "60"]






def test_an_etcd_outage_while_a_newcomer_gets_ready_is_ridden_out(private_etcd, job_id, agents, tmp_path):
    log, gate = tmp_path / "steps.jsonl", tmp_path / "gate"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "2000", "INPLACE_PACE": "0.1"}
    a = {n: agents(inplace_args(private_etcd.endpoint, job_id, n, heartbeat=HB, extra=GUARD), name=n, env=env)
         for n in "AB"}
    wait_until(lambda: sum(r["world"] == 2 for r in log_steps(log)) >= 4, 150, "steps at world size 2")
    survivors = {r["pid"] for r in log_steps(log)}
    a["C"] = agents(inplace_args(private_etcd.endpoint, job_id, "C", heartbeat=HB, extra=GUARD), name="C",
                    env={**env, "INPLACE_START_GATE": str(gate)})
    wait_until(lambda: Path(f"{gate}.waiting").exists(), 150, "C's worker started, waiting at the gate")
    store = connect(private_etcd.endpoint)
    try:
        assert sorted(json.loads(store.get(JobKeys(job_id).topology).value).get("inplace", [])) == ["A", "B"]
    finally:
        store.close()
    os.kill(private_etcd.proc.pid, signal.SIGSTOP)
    try:
        gate.touch()  # C's worker gets ready now: its agent's ready/C write meets the outage
        time.sleep(OUTAGE_S)  # the outage itself
    finally:
        os.kill(private_etcd.proc.pid, signal.SIGCONT)

    def world3() -> bool:
        for name, agent in a.items():
            assert agent.proc.poll() is None, f"agent {name} exited {agent.proc.returncode}: {agent.stderr()}"
        return sum(r["world"] == 3 for r in log_steps(log)) >= 6
    wait_until(world3, 90, "steps at world size 3")
    at3 = {r["pid"] for r in log_steps(log) if r["world"] == 3}
    assert survivors <= at3, "the survivors re-formed in place (same worker processes)"
    assert "etcd does not answer while telling the survivors we are ready" in a["C"].stderr(), a["C"].stderr()
