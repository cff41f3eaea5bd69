"""The exit-code table (elasticrun.job.exitcodes) and docs/deploy.md agree, and each transient row exits retryable.

Rows tested elsewhere with real agents: 143/130 drains (test_launch_signals, test_liveness), 138 when etcd
is unreachable at the start or lost beyond the grace (test_cli_run, test_outage), 2 for refused credentials
and bad flags (test_cli_run), 1 after the restart budget (test_launch_restart), 5 (test_cli_ckpt).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticrun.errors import (
    CheckpointError,
    ConfigError,
    JobFailedError,
    RendezvousError,
    StoreError,
    StoreSetupError,
)
from elasticrun.job.exitcodes import RETRYABLE, ExitCode, for_error, for_signal
from elasticrun.launch.agent import Agent
from elasticrun.launch.config import LaunchConfig
from elasticrun.rendezvous.settings import JobEnded
from elasticrun.store.server import EtcdServer

from helpers.launch import ECHO, REPO, assert_one_line_error, run_cli

pytestmark = pytest.mark.integration  # starts etcd or processes

KUBEFLOW_RETRYABLE = {130, 137, 138, 143}  # PyTorchJob's ExitCode restart policy retries these, and no others


def test_retryable_codes_are_the_ones_kubeflow_retries() -> None:
    assert {int(c) for c in RETRYABLE} <= KUBEFLOW_RETRYABLE
    permanent = {c for c in ExitCode if not c.retryable}
    assert not {int(c) for c in permanent} & KUBEFLOW_RETRYABLE
    assert for_signal(signal.SIGTERM) == ExitCode.DRAINED == 143
    assert for_signal(signal.SIGINT) == ExitCode.INTERRUPTED == 130
    assert for_signal(signal.SIGHUP) == for_signal(signal.SIGUSR1) == ExitCode.DRAINED


@pytest.mark.parametrize("err,code", [
    (StoreError("cannot reach etcd"), ExitCode.TRANSIENT),
    (StoreSetupError("etcd rejected user 'u'"), ExitCode.USAGE),
    (RendezvousError("only 1 of at least 2 nodes joined"), ExitCode.TRANSIENT),
    (JobFailedError("workers failed"), ExitCode.JOB_FAILED),
    (ConfigError("--nnodes"), ExitCode.USAGE),
    (CheckpointError("no checkpoint"), ExitCode.CHECKPOINT),
])
def test_every_error_has_its_row(err: Exception, code: ExitCode) -> None:
    assert for_error(err) == code


def test_docs_table_is_the_code_table() -> None:
    """docs/deploy.md's exit-code table lists exactly the members of ExitCode, with their retryability."""
    text = (Path(REPO) / "docs" / "deploy.md").read_text()
    rows = re.findall(r"^\| `(\d+)` \| `(\w+)` \| (yes|no) \|", text, re.M)
    assert {(int(n), name, flag == "yes") for n, name, flag in rows} == {
        (int(c), c.name, c.retryable) for c in ExitCode
    }


class _Rdzv:
    def root_cause(self, _round: int) -> list:
        return []


@pytest.mark.parametrize("state,code", [
    ({"state": "failed", "reason": "workers failed and all 3 restarts are used up", "round": 4}, ExitCode.JOB_FAILED),
    ({"state": "failed", "reason": "only 1 of at least 2 nodes joined within 5s", "round": 4, "exit_code": 138},
     ExitCode.TRANSIENT),
    ({"state": "failed", "reason": "x", "round": 4, "exit_code": "junk"}, ExitCode.JOB_FAILED),
])
def test_a_node_exits_with_the_code_of_the_node_that_ended_the_job(state: dict, code: ExitCode) -> None:
    agent = Agent.__new__(Agent)
    agent.cfg = LaunchConfig.of({"rendezvous.rdzv_id": "j"})
    agent.say = lambda _msg: None
    agent.obs = SimpleNamespace(finish=lambda _outcome: None)  # no metrics/goodput in this unit test
    with pytest.raises(JobFailedError) as info:
        agent._ended(_Rdzv(), JobEnded(state))  # type: ignore[arg-type]
    assert for_error(info.value) == code


def test_rendezvous_timeout_is_retryable(etcd_server: EtcdServer, job_id: str) -> None:
    """Too few nodes within --join-timeout: nodes may still come, so the scheduler should retry (138)."""
    started = time.monotonic()
    proc = run_cli(["--nnodes", "2", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id,
                    "--join-timeout", "2", ECHO], timeout=60)
    assert_one_line_error(proc, "only 1 of at least 2 nodes joined", "start more nodes")
    assert proc.returncode == ExitCode.TRANSIENT, proc.stderr
    assert time.monotonic() - started < 40
