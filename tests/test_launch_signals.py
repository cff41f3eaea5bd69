"""Signals: SIGTERM/SIGINT to an agent stop its workers and take its node out of etcd; after SIGKILL of
the agent its workers still die (parent-death signal) and its lease expires."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable, List, Tuple

import pytest

from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer

from helpers.launch import ECHO, alive, node_ids
from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes


def _sleeping_job(
    agents: Callable[..., Agent], endpoint: str, job: str, pid_dir: Path, *extra: str
) -> Tuple[Agent, List[int]]:
    """One agent with two echo workers that sleep a minute; returns it once both workers run, with their pids."""
    pid_dir.mkdir()
    agent = agents(
        ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
         "--node-id", "sig0", "--shutdown-timeout", "3", *extra, ECHO],
        env={"ECHO_SLEEP_S": "60", "ECHO_PID_DIR": str(pid_dir)},
    )
    files = wait_until(lambda: len(list(pid_dir.glob("*.pid"))) == 2 and sorted(pid_dir.glob("*.pid")), 60,
                       "two running workers")
    return agent, [int(f.read_text()) for f in files]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_workers_and_leaves_etcd(
    sig: signal.Signals, tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore,
    job_id: str,
) -> None:
    agent, workers = _sleeping_job(agents, etcd_server.endpoint, job_id, tmp_path / "pids")
    assert all(alive(pid) for pid in workers)
    assert node_ids(etcd, job_id) == ["sig0"]
    family = [p.pid for p in agent.descendants()]  # workers, pre-warmed interpreters, shims
    agent.signal(sig)
    code = agent.wait(30)
    assert code == 128 + sig, agent.output()
    left = [pid for pid in family if alive(pid)]
    assert not left, f"processes left behind by the agent: {left}"
    assert node_ids(etcd, job_id) == [], "the agent must revoke its lease (node key gone at once)"
    assert f"received {sig.name}" in agent.stderr()


def test_sigkill_of_the_agent_takes_its_workers_down(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str
) -> None:
    agent, workers = _sleeping_job(agents, etcd_server.endpoint, job_id, tmp_path / "pids", "--heartbeat-timeout", "2")
    family = [p.pid for p in agent.descendants()]
    agent.signal(signal.SIGKILL)
    assert agent.wait(10) == -signal.SIGKILL
    wait_until(lambda: not any(alive(pid) for pid in family), 10, "workers to die with their agent")
    # Nobody revoked the lease: the node key goes when it expires (TTL 2 s).
    started = time.monotonic()
    wait_until(lambda: node_ids(etcd, job_id) == [], 10, "the node's lease to expire")
    assert time.monotonic() - started < 8

