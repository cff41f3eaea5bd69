"""etcd outages with real agents, a real (private) etcd and real workers.

An outage is etcd SIGSTOPped: every client call hangs until its deadline, the leases expire
when etcd resumes. Workers must keep training through an outage shorter than
``--etcd-outage-grace`` (same pids, steps advance while etcd is stopped, the job finishes at
its first round), and get SIGTERM (the chance to save), never SIGKILL, when an outage lasts
longer.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.store.client import connect

from helpers.elastic import HB, agent_args, first_step, steps, worker_pids
from helpers.procs import SCRIPTS, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

TERM_SAVER = str(SCRIPTS / "term_saver.py")


def test_workers_train_through_an_etcd_outage(private_etcd, job_id, agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--etcd-outage-grace", "30", "--etcd-timeout", "3"]
    # 150 steps: the outage (2 * HB) plus >= 6 s of training after it (checked below), past the lease the
    # agents must grant again and the store's call deadline, so a re-formed job would show
    a = [agents(agent_args(private_etcd.endpoint, job_id, n, "2", out, 150, extra), name=n) for n in "AB"]
    wait_until(lambda: first_step(out, 2), 60, "training at world size 2")
    pids = {n: worker_pids(out, n) for n in "AB"}
    assert all(len(p) == 1 for p in pids.values()), pids
    os.kill(private_etcd.proc.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        time.sleep(2 * HB)  # the outage itself: etcd stopped for twice the lease TTL
        during = [r for r in steps(out) if r["time"] > stopped_at + HB]
    finally:
        os.kill(private_etcd.proc.pid, signal.SIGCONT)
    resumed_at = time.time()
    assert len(during) >= 5, f"training must go on while etcd is stopped: {len(during)} step(s) after the TTL"
    for ag in a:
        assert ag.wait(120) == 0, ag.output()
    assert (out / "finished").exists()
    assert {n: worker_pids(out, n) for n in "AB"} == pids, "the workers must not have been restarted"
    assert {r["round"] for r in steps(out)} == {0}, "the job must finish in its first round"
    after = steps(out)[-1]["time"] - resumed_at
    assert after >= 6, f"the job ended {after:.1f}s after the outage: too soon to see the agents recover"
    store = connect(private_etcd.endpoint)
    try:
        assert json.loads(store.get(JobKeys(job_id).topology).value)["round"] == 0
    finally:
        store.close()
    err = a[0].stderr() + a[1].stderr()
    assert "etcd does not answer" in err, err


def test_outage_past_the_grace_stops_workers_with_sigterm(private_etcd, job_id, agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = agents(
        ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", private_etcd.endpoint, "--rdzv-id", job_id,
         "--node-id", "g0", "--heartbeat-timeout", str(HB), "--shutdown-timeout", "5", "--etcd-outage-grace", "3",
         "--etcd-timeout", "2", TERM_SAVER, str(out)],
    )
    wait_until(lambda: (out / "0.pid").exists() and (out / "1.pid").exists(), 60, "two running workers")
    os.kill(private_etcd.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    code = agent.wait(90)
    took, exited = time.monotonic() - started, time.time()
    err = agent.stderr()
    assert code == ExitCode.TRANSIENT, agent.output()  # 138: etcd lost beyond the grace is retryable
    assert "--etcd-outage-grace" in err, err
    for rank in (0, 1):
        assert (out / f"{rank}.SIGTERM").exists(), f"rank {rank} was not given SIGTERM (killed without a save)\n{err}"
    assert took >= 3, f"workers stopped before the outage grace ({took:.1f}s)"
    # Leaving on an etcd error, the teardown waits on no etcd call (no final report, no revoke: each
    # would wait out a whole call deadline; the exit came 10.5-11 s after the workers' SIGTERM then).
    after_term = exited - (out / "0.SIGTERM").stat().st_mtime
    assert after_term < 6, f"the agent exited {after_term:.1f}s after its workers' SIGTERM\n{err}"
    assert "Traceback" not in err, err
