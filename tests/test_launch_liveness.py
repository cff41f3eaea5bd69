"""Liveness and stop signals with real agents, real etcd and real workers.

- An agent whose main loop stalls (tests/scripts/stalled_agent.py sleeps in its first lease
  check) stops refreshing its lease: the others re-form without it within about the heartbeat timeout; when it wakes
  it fences itself and rejoins.
- SIGHUP and SIGQUIT stop an agent like SIGTERM: its workers get SIGTERM (and the grace to
  save), its node leaves etcd at once.
"""

from __future__ import annotations

import signal
import sys
import time

import pytest

from elasticrun.job.exitcodes import ExitCode

from helpers.elastic import HB, agent_args, all_gone, first_step, steps, worker_pids
from helpers.launch import alive, node_ids
from helpers.procs import SCRIPTS, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

TERM_SAVER = str(SCRIPTS / "term_saver.py")
STALLED_AGENT = str(SCRIPTS / "stalled_agent.py")
STALL_S = 15.0  # B's round loop stalls this long, at its first turn


def test_stalled_agent_is_dropped_within_the_heartbeat_timeout(etcd_server, etcd, job_id, agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    a = agents(agent_args(etcd_server.endpoint, job_id, "A", "1:2", out, 5000), name="A")
    wait_until(lambda: first_step(out, 1), 60, "A training alone")
    b = agents(agent_args(etcd_server.endpoint, job_id, "B", "1:2", out, 5000), name="B",
               program=[sys.executable, STALLED_AGENT, str(STALL_S)])
    # B's round loop stalls at its first turn, right after it started its workers (its process runs:
    # this is not SIGSTOP). Its lease must lapse and A re-form alone, within about the heartbeat timeout.
    # The stall begins once B's workers started (forking them can take seconds on a loaded machine).
    wait_until(lambda: "(ScaleUp)" in b.stderr(), 60, "B's first round")
    wait_until(lambda: "workers started" in b.stderr(), 60, "B's workers of its first round")
    stall_began = time.monotonic()
    wait_until(lambda: "node B left or lost its lease" in a.stderr(), 2 * HB + 30, "A to drop the stalled B")
    dropped_after = time.monotonic() - stall_began
    # stall detection (HB/2, at least 2 s) + lease expiry (HB) + margin
    assert dropped_after < 2 * HB + 8, f"A dropped the stalled B only after {dropped_after:.1f}s"
    wait_until(lambda: "(ScaleDown)" in a.stderr(), 30, "A to re-form alone")
    assert b.proc.poll() is None
    old_b = worker_pids(out, "B")
    # When B's loop turns again it fences itself (its workers stopped) and rejoins.
    wait_until(lambda: "fencing" in b.stderr(), STALL_S + 20, "B to fence itself")
    wait_until(lambda: all_gone(old_b), 20, "B's stale workers to be gone")
    rejoined_after = time.time()
    wait_until(lambda: any(r["world"] == 2 and r["time"] > rejoined_after for r in steps(out)), 60, "B back in")
    a.signal(signal.SIGTERM)
    b.signal(signal.SIGTERM)
    a.wait(30)
    b.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT], ids=["SIGHUP", "SIGQUIT"])
def test_hup_and_quit_stop_gracefully(sig, etcd_server, etcd, job_id, agents, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    agent = agents(
        ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id,
         "--node-id", "hq0", "--shutdown-timeout", "10", TERM_SAVER, str(out)],
    )
    wait_until(lambda: (out / "0.pid").exists() and (out / "1.pid").exists(), 60, "two running workers")
    workers = [int((out / f"{r}.pid").read_text()) for r in (0, 1)]
    assert node_ids(etcd, job_id) == ["hq0"]
    agent.signal(sig)
    assert agent.wait(30) == ExitCode.DRAINED, agent.output()  # drained like SIGTERM: 143, retryable
    for rank in (0, 1):
        assert (out / f"{rank}.SIGTERM").exists(), f"rank {rank} got no SIGTERM (no chance to save)"
    assert not any(alive(p) for p in workers)
    assert node_ids(etcd, job_id) == [], "the node must leave etcd at once (lease revoked)"
    assert f"received {sig.name}" in agent.stderr()
