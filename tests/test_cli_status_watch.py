"""``elasticrun status --watch`` ends with the job (exit code = outcome); finished nodes show Finished, not Lost.

Real etcd, real agents and workers (the cheap echo worker), status as a real process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable, Dict, List

import pytest

from elasticrun.rendezvous.jobstatus import JobNotFoundError, job_status
from elasticrun.rendezvous.states import MemberStatus
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer

from helpers.launch import ECHO
from helpers.procs import REPO, wait_until, worker_env

pytestmark = pytest.mark.integration  # starts etcd or processes


def _job_visible(etcd: EtcdStore, job: str) -> bool:
    try:
        return job_status(etcd, job, leases=False)["round"] is not None
    except JobNotFoundError:
        return False


def _watch(etcd_server: EtcdServer, job: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job,
         "--watch", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO), env=worker_env(),
    )


def _run_job(agents: Callable[..., Any], etcd_server: EtcdServer, etcd: EtcdStore, job: str,
             env: Dict[str, str]) -> List[Dict[str, Any]]:
    """Run a 1-node job while ``status --watch --json`` follows it; the watcher's documents."""
    agent = agents(["--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job,
                    "--max-restarts", "0", "-q", ECHO], env={"ECHO_SLEEP_S": "3", **env})
    wait_until(lambda: _job_visible(etcd, job), 60, "the job's first round")
    watcher = _watch(etcd_server, job)
    try:
        out, err = watcher.communicate(timeout=90)  # returns only because the watch ended with the job
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    agent.wait(60)
    docs = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert docs, err
    docs[-1]["_exit"] = watcher.returncode
    return docs


def test_watch_ends_with_success_and_nodes_show_finished(agents, etcd_server, etcd, job_id) -> None:
    docs = _run_job(agents, etcd_server, etcd, job_id, {})
    assert docs[-1]["_exit"] == 0 and docs[-1]["phase"] == "succeeded"
    doc = job_status(etcd, job_id)  # after the agent left
    assert doc["phase"] == "succeeded"
    assert [m["status"] for m in doc["members"]] == ["Finished"], doc["members"]
    assert all(m["status"] != MemberStatus.LOST for d in docs for m in d["members"])


def test_watch_exit_code_is_the_jobs_failure(agents, etcd_server, etcd, job_id) -> None:
    docs = _run_job(agents, etcd_server, etcd, job_id, {"ECHO_FAIL_RANK_AT_RESTART": "0:0"})
    assert docs[-1]["_exit"] == 1 and docs[-1]["phase"] == "failed"
