"""A failure after an in-place re-form is charged to ``--max-restarts`` (only the re-form's own are free).

Real agents, a real etcd, real gloo workers (tests/scripts/inplace_worker.py). Under
``--max-restarts 0``, A and B train; B leaves gracefully and A re-forms in place alone. Seconds
later A's worker crashes: that is no failed re-form, so the job has no restart left and fails at
once, in the re-formed round. (The restart after a failed re-form stays free:
tests/test_launch_inplace.py::test_failed_reform_falls_back_to_restart.)
"""

from __future__ import annotations

import signal

import pytest

from elasticrun.job.keys import JobKeys

from helpers.inplace import inplace_args, log_rows
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]






def test_a_crash_after_a_finished_reform_uses_a_restart(etcd_server, etcd, job_id, agents, tmp_path):
    log, crash = tmp_path / "steps.jsonl", tmp_path / "crash"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "4000", "INPLACE_PACE": "0.05",
           "INPLACE_CRASH_FILE": str(crash)}
    keys = JobKeys(job_id)
    a = {n: agents(inplace_args(etcd_server.endpoint, job_id, n, "1:2"), name=n, env=env) for n in "AB"}
    wait_until(lambda: sum(r.get("world") == 2 for r in log_rows(log)) >= 4, 150, "steps at world size 2")
    a["B"].signal(signal.SIGTERM)  # graceful leave: A re-forms in place at world size 1
    wait_until(lambda: any("reformed" in r for r in log_rows(log)), 150, "A re-formed in place")
    wait_until(lambda: sum(r.get("world") == 1 for r in log_rows(log)) >= 4, 150, "steps at world size 1")
    reformed = etcd.get_json(keys.topology)
    assert reformed.get("inplace") == ["A"], reformed
    crash.touch()
    assert a["A"].wait(120) != 0, a["A"].output()
    state = etcd.get_json(keys.state)
    assert state["state"] == "failed" and "restart(s) are used up" in state["reason"], state
    assert etcd.get_json(keys.topology)["round"] == reformed["round"], "no free restart round after the crash"
