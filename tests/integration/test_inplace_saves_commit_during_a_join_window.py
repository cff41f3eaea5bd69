"""Survivors' checkpoint saves commit while a slow newcomer starts (the in-place join window).

Real agents, a real etcd, real gloo workers (tests/scripts/inplace_worker.py). Nodes A and B train;
C joins and takes 6 s to start. The leader writes round 1 (A and B re-form in place) as soon as C
joins; A and B keep training round 0 until C is ready, saving a checkpoint every 3 steps. Those
saves are the job's: every one commits. After the re-form the saves commit in round 1. The job is
not run to its end (the agents are stopped at teardown).
"""

from __future__ import annotations

import pytest

from elasticrun.checkpoint import list_checkpoints
from elasticrun.job.keys import JobKeys

from helpers.inplace import inplace_args, log_rows
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]






def test_survivors_saves_commit_while_a_newcomer_starts(etcd_server, etcd, job_id, agents, tmp_path):
    log, ckpts = tmp_path / "steps.jsonl", tmp_path / "ckpts"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "2000", "INPLACE_PACE": "0.1", "INPLACE_CKPT_DIR": str(ckpts),
           "INPLACE_CKPT_EVERY": "3"}
    a = {n: agents(inplace_args(etcd_server.endpoint, job_id, n), name=n, env=env) for n in "AB"}
    wait_until(lambda: any("saved" in r for r in log_rows(log)), 150, "a first save at world size 2")
    a["C"] = agents(inplace_args(etcd_server.endpoint, job_id, "C"), name="C", env={**env, "INPLACE_START_DELAY": "6"})
    wait_until(lambda: any(r.get("round", 0) >= 1 and ("saved" in r or "refused" in r) for r in log_rows(log)), 150,
               "a save after the re-form")
    topo = etcd.get_json(JobKeys(job_id).topology)
    assert topo["round"] == 1 and sorted(topo["inplace"]) == ["A", "B"], topo
    saves = [r for r in log_rows(log) if "saved" in r or "refused" in r]
    in_window = [r for r in saves if r["round"] == 0 and r["t"] > topo["created_at"]]
    assert len(in_window) >= 3, f"saves while C started: {in_window}"
    refused = [r for r in saves if "refused" in r]
    assert not refused, f"saves of the survivors were refused: {refused}"
    complete = {c.name for c in list_checkpoints(str(ckpts)) if c.status.value == "complete"}
    assert {r["saved"] for r in in_window} <= complete, "the window's saves are committed checkpoints"
