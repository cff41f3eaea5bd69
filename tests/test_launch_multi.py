"""Two and three agents on loopback forming one job: ranks, group ranks, one master store."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer

from helpers.launch import REPORT_ENV, node_ids, reports
from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes


def _agent(agents: Callable[..., Agent], endpoint: str, job: str, nnodes: int, nproc: int, out: Path, i: int) -> Agent:
    """Start agent ``node<i>`` of a job running report_env.py."""
    return agents(
        ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint,
         "--rdzv-id", job, "--node-id", f"node{i}", REPORT_ENV, str(out)],
        name=f"node{i}",
    )


@pytest.mark.parametrize("nnodes,nproc", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
def test_agents_form_one_job(
    nnodes: int, nproc: int, tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer,
    etcd: EtcdStore, job_id: str,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    started = [_agent(agents, etcd_server.endpoint, job_id, nnodes, nproc, out, i) for i in range(nnodes)]
    for a in started:
        assert a.wait(90) == 0, a.output()
    world = nnodes * nproc
    rows = reports(out)
    assert sorted(int(r["RANK"]) for r in rows) == list(range(world)), "global ranks must be 0..N-1, unique"
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in rows} == {(rows[0]["MASTER_ADDR"], rows[0]["MASTER_PORT"])}
    by_node: Dict[str, List[dict]] = defaultdict(list)
    for r in rows:
        by_node[r["ELASTICRUN_NODE_ID"]].append(r)
        assert r["WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == str(world)
        assert r["GROUP_WORLD_SIZE"] == str(nnodes)
        assert r["LOCAL_WORLD_SIZE"] == str(nproc)
        assert r["sum"] == r["expected_sum"] == world * (world - 1) / 2
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert len(r["gathered"]) == world
        # The suite hides GPUs from the simulated nodes (tests/conftest.py): on a GPU host, NCCL would
        # bind every node's LOCAL_RANK 0 to the same device.
        assert (r["CUDA_VISIBLE_DEVICES"], r["ELASTICRUN_BACKEND"]) == ("", "gloo")
    assert sorted(by_node) == [f"node{i}" for i in range(nnodes)]
    group_ranks = set()
    for node, node_rows in by_node.items():
        assert len(node_rows) == nproc, f"{node} ran {len(node_rows)} workers"
        (group_rank,) = {int(r["GROUP_RANK"]) for r in node_rows}  # one group rank per node
        group_ranks.add(group_rank)
        assert sorted(int(r["LOCAL_RANK"]) for r in node_rows) == list(range(nproc))
        for r in node_rows:
            assert int(r["RANK"]) == group_rank * nproc + int(r["LOCAL_RANK"])
    assert group_ranks == set(range(nnodes))
    # The master store is hosted by the group-rank-0 node's agent, and every agent left the job.
    assert node_ids(etcd, job_id) == []


def test_late_node_waits_for_min(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str
) -> None:
    """With --nnodes 2 the first agent registers and waits; nothing runs until the second one comes."""
    out = tmp_path / "out"
    out.mkdir()
    first = _agent(agents, etcd_server.endpoint, job_id, 2, 1, out, 0)
    wait_until(lambda: node_ids(etcd, job_id) == ["node0"], 30, "node0 registered")
    assert "waiting for nodes" in wait_until(
        lambda: "waiting for nodes" in first.stderr() and first.stderr(), 30, "a waiting message"
    )
    assert first.proc.poll() is None and reports(out) == []
    second = _agent(agents, etcd_server.endpoint, job_id, 2, 1, out, 1)
    assert first.wait(60) == 0 and second.wait(60) == 0, first.output() + second.output()
    assert sorted(r["RANK"] for r in reports(out)) == ["0", "1"]
