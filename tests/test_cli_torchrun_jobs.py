"""torchrun's multi-node command lines, copied from its docs, run a real 2-node job on loopback.

Two agent processes, one gloo worker each (tests/scripts/report_env.py), no etcd started by
the test: the job hosts its own (c10d: the agent that binds the endpoint first; static: node
rank 0). The workers' RANK / WORLD_SIZE / GROUP_RANK are checked, and that a restart
(c10d) and `elasticrun status` (static) work on the etcd the job hosts.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from elasticrun.job.exitcodes import ExitCode, for_signal
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer, free_port

from helpers.launch import ECHO, REPORT_ENV, alive, assert_one_line_error, node_ids, reports, run_cli, wait_agents
from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

HOSTING = "hosting the job's etcd"
SLACK = ["--heartbeat-timeout", "15"]  # 2 loaded cores: a 5 s lease can lapse before the first keep-alive


def _ranks(out: Path, round_: str = "0") -> Dict[str, Dict[str, str]]:
    """node id → the env its (only) worker reported in round ``round_``."""
    rows = [r for r in reports(out) if r["ELASTICRUN_ROUND"] == round_]
    return {r["ELASTICRUN_NODE_ID"]: r for r in rows}


def test_c10d_min_max_two_nodes_host_their_own_etcd(agents: Callable[..., Agent], tmp_path: Path) -> None:
    # torchrun docs: torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID
    #                --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    started = [
        agents(["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-id=c10djob",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-conf=last_call_timeout=60", f"--node-id=n{i}", *SLACK, REPORT_ENV, str(out)], name=f"n{i}",
               env={"FAIL_RANK_AT_RESTART": "1:0"})  # rank 1 fails once: the job restarts (restart 1)
        for i in range(2)
    ]
    assert wait_agents(started, 120) == [0, 0], "\n".join(a.output()[-3000:] for a in started)
    seen = _ranks(out, "1")
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in seen.values()} == {"1"}
    assert sorted(seen) == ["n0", "n1"], seen
    assert sorted((r["RANK"], r["GROUP_RANK"]) for r in seen.values()) == [("0", "0"), ("1", "1")]
    assert {(r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"], r["ELASTICRUN_RDZV_ENDPOINT"]) for r in seen.values()} == {
        ("2", "2", f"127.0.0.1:{port}")}
    assert all(r["sum"] == r["expected_sum"] == 1.0 for r in seen.values())
    hosts = [a.name for a in started if HOSTING in a.stderr()]
    assert len(hosts) == 1, "exactly one agent hosts the job's etcd; the other joins it"


def test_static_node_ranks_are_kept_and_pet_variables_work(agents: Callable[..., Agent], tmp_path: Path) -> None:
    # torchrun docs: torchrun --nnodes=2 --nproc-per-node=1 --node-rank=R --master-addr=HOST --master-port=PORT
    # Node rank 1 starts first, and from PET_* variables (as Kubeflow's PyTorchJob sets them).
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(port), "SLEEP_S": "6"}
    second = agents(["--node-id", "rank1", *SLACK, REPORT_ENV, str(out)], name="rank1", env=pet)
    wait_until(lambda: "joining the job's etcd" in second.stderr(), 60, "node rank 1 to wait for node rank 0")
    first = agents(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--node-id", "rank0", *SLACK, REPORT_ENV, str(out)], name="rank0",
                   env={"SLEEP_S": "6"})
    # While it runs, `elasticrun status` reads the job from the etcd it hosts.
    wait_until(lambda: all("round 0 (Start)" in a.stderr() for a in (first, second)), 60, "round 0 to start")
    status = run_cli(["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "default", "--json"], timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    doc = json.loads(status.stdout)
    assert sorted((m["node_id"], m["group_rank"]) for m in doc["members"]) == [("rank0", 0), ("rank1", 1)], doc
    assert wait_agents([first, second], 120) == [0, 0], first.output()[-3000:] + second.output()[-3000:]
    seen = _ranks(out)
    assert {n: (r["RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for n, r in seen.items()} == {
        "rank0": ("0", "0", "2"), "rank1": ("1", "1", "2")}
    assert HOSTING in first.stderr() and HOSTING not in second.stderr()


def test_two_nodes_with_the_same_node_rank(
    agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str
) -> None:
    args = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--nnodes", "2",
            "--node-rank", "1", "--etcd-timeout", "5", *SLACK]
    waiting = agents([*args, "--node-id", "a", ECHO], name="a")
    wait_until(lambda: node_ids(etcd, job_id) == ["a"], 30, "the first node to register")
    proc = run_cli([*args, "--node-id", "b", ECHO], timeout=60)
    assert_one_line_error(proc, "--node-rank 1 is already taken", "'a'")
    assert proc.returncode == 2
    assert node_ids(etcd, job_id) == ["a"] and waiting.proc.poll() is None
    waiting.signal(15)
    assert waiting.wait(30) == 143


def test_static_node_waits_for_rank_0_within_the_join_timeout(tmp_path: Path) -> None:
    port = free_port()
    proc = run_cli(["--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--join-timeout", "2", ECHO],
                   timeout=60, env={"OMP_NUM_THREADS": "1"})
    assert_one_line_error(proc, f"no etcd at 127.0.0.1:{port}", "start node rank 0")
    assert proc.returncode == ExitCode.TRANSIENT  # rank 0 may still come: retryable


@pytest.mark.parametrize("sig,extra", [(signal.SIGHUP, []), (signal.SIGUSR1, ["--signals-to-handle", "SIGUSR1"])],
                         ids=["SIGHUP-default", "SIGUSR1-flag"])
def test_signals_to_handle_are_forwarded_to_the_workers(
    sig: signal.Signals, extra: List[str], agents: Callable[..., Agent], tmp_path: Path
) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    agent = agents(["--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "3", *extra, ECHO],
                   env={"ECHO_SLEEP_S": "60", "ECHO_PID_DIR": str(pid_dir)})
    pid_file = wait_until(lambda: next(iter(pid_dir.glob("*.pid")), None), 60, "the worker to start")
    worker = int(pid_file.read_text())
    agent.signal(sig)
    assert agent.wait(30) == for_signal(sig) == ExitCode.DRAINED, agent.output()  # 143, retryable
    assert f"received {sig.name}" in agent.stderr()
    wait_until(lambda: not alive(worker), 10, "the worker to be stopped")
