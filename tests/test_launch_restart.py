"""Worker failures: one crash is restarted on every node (every time), with workers forked from the fork
server; persistent crashes end the job.

torchrun 2.13 on this kind of machine fails or hangs in most such restarts (the restarted gloo workers
read a dead peer's address from the reused store), so the fail-once scenario is repeated 6 times.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, List

import pytest

from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer

from helpers.launch import REPORT_ENV, node_ids, reports, wait_agents
from helpers.procs import Agent

pytestmark = pytest.mark.integration  # starts etcd or processes

REPS = 6


def _job(
    agents: Callable[..., Agent], endpoint: str, job: str, out: Path, env: dict, max_restarts: int, nproc: int = 1
) -> List[Agent]:
    """Two agents of one job on loopback running report_env.py."""
    return [
        agents(
            ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint, "--rdzv-id", job,
             "--node-id", f"node{i}", "--max-restarts", str(max_restarts), "--shutdown-timeout", "2",
             REPORT_ENV, str(out)],
            name=f"node{i}",
            env={**env, "COLUMNS": "240"},  # a wide root-cause table: messages stay on one line
        )
        for i in range(2)
    ]


@pytest.mark.parametrize("rep", range(REPS))
def test_worker_failing_once_is_restarted_on_every_node(
    rep: int, tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, job_id: str
) -> None:
    """2 nodes x 1 worker, gloo; the crashing rank alternates between the store-hosting node and the other."""
    out = tmp_path / "out"
    out.mkdir()
    failing = rep % 2
    nodes = _job(agents, etcd_server.endpoint, job_id, out, {"FAIL_RANK_AT_RESTART": f"{failing}:0"}, 1)
    assert wait_agents(nodes, 120) == [0, 0], "\n".join(a.output() for a in nodes)
    rows = reports(out)
    # Nobody finished attempt 0 (rank `failing` raised before the all-reduce); everyone finished attempt 1.
    assert [(r["RANK"], r["TORCHELASTIC_RESTART_COUNT"], r["ELASTICRUN_ROUND"]) for r in rows] == [
        ("0", "1", "1"),
        ("1", "1", "1"),
    ], rows
    assert sorted(r["ELASTICRUN_NODE_ID"] for r in rows) == ["node0", "node1"]
    for r in rows:
        assert r["sum"] == r["expected_sum"] == 1.0
        assert r["prefixed"]["ELASTICRUN_RESCALE_TYPE"] == "Restart"
        assert r["prefixed"]["ELASTICRUN_PREV_WORLD_SIZE"] == "2"
    # Ranks are stable across the restart: the node that runs rank `failing` now is the one that saw it fail.
    (failed_node,) = [r["ELASTICRUN_NODE_ID"] for r in rows if r["RANK"] == str(failing)]
    culprit = nodes[int(failed_node[-1])]
    assert f"worker rank {failing} failed" in culprit.stderr(), culprit.stderr()
    # The first round's worker started at once (forked from the bare fork server, or fresh while that
    # was still starting: it waits for nothing torchrun's would not); the restart's came from the server.
    for a in nodes:
        assert re.search(r"round 0: workers started \(1 (forked|fresh) in \d+ ms\)", a.stderr()), a.stderr()
        assert re.search(r"round 1: workers started \(1 forked in \d+ ms\)", a.stderr()), a.stderr()


def test_always_failing_worker_exhausts_restarts_and_every_agent_shows_the_root_cause(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    nodes = _job(agents, etcd_server.endpoint, job_id, out, {"ALWAYS_FAIL_RANK": "1"}, 1)
    assert wait_agents(nodes, 120) == [1, 1], "\n".join(a.output() for a in nodes)  # JobFailedError's code
    assert reports(out) == []
    # Group ranks follow registration order: find the node that ran rank 1.
    (culprit,) = [a.name for a in nodes if "ranks 1..1" in a.stderr()]
    for a in nodes:
        err = a.stderr()
        assert "restart(s) are used up" in err, err
        # The table: root-cause row names the culprit node, rank 1, exit code 1 and the worker's own message
        # (read from TORCHELASTIC_ERROR_FILE, written by @record).
        root = [ln for ln in err.splitlines() if "(root cause)" in ln]
        assert root, err
        row = rf"{culprit} \(root cause\)\s*│\s*1 \(local 0\)\s*│\s*1\s*│.*rank 1 always fails"
        assert re.search(row, root[0]), root[0]
        last = err.strip().splitlines()[-1]
        assert last.startswith("elasticrun: error: job") and "restart(s) are used up" in last, last
    assert node_ids(etcd, job_id) == []
