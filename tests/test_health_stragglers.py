"""Straggler detection and drain with real agents, a real etcd and gloo workers of examples/train.py.

Three nodes of one worker each, ~7 ms of compute a step (a real workload's ratio, not the scheduler's
noise on a 2 ms step); one node's worker takes 30 ms more of every step's compute (``TRAIN_COMPUTE_SLEEP``,
as a slower device would), so it scores about four times the median whatever the load on the machine.
With ``--straggler-action warn`` that node is flagged in ``elasticrun status --json`` (and nobody
else is); with ``drain`` it leaves the job (exit 6, recorded as excluded, a ``drained`` event) and the job
trains on at world 2. Also: ``elasticrun check`` on this machine passes and prints its table.

Healthy nodes' own scores are not what these tests judge (with one slow node of three, the median is
the slower healthy one); the unit tests (tests/unit/health/test_straggler.py) hold the threshold, the
floor and the window, and ``scripts/bench/bench_stragglers.py`` measures false positives with the default
window.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

from elasticrun.store.server import EtcdServer

from helpers.procs import REPO, Agent, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

EXAMPLE = str(REPO / "examples" / "train.py")
WINDOW_S = 6.0
FLAG_WITHIN_S = 60.0
SLOW_COMPUTE_S = 0.03  # node nc's extra compute per step


def status(etcd_server: EtcdServer, job: str) -> Optional[Dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", etcd_server.endpoint,
                           "--rdzv-id", job, "--json"], capture_output=True, text=True, timeout=60, cwd=str(REPO))
    return json.loads(done.stdout) if done.returncode == 0 else None


def events_of(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def members(doc: Optional[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {m["node_id"]: m for m in (doc or {}).get("members") or []}


def start_three(agents: Callable[..., Agent], etcd_server: EtcdServer, job: str, action: str,
                tmp_path: Path) -> List[Agent]:
    started = []
    for name in ("na", "nb", "nc"):
        started.append(agents([
            "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job,
            "--node-id", name, "--heartbeat-timeout", "4", "--stability-window", "3", "--shutdown-timeout", "5",
            "--straggler-window", str(WINDOW_S), "--straggler-action", action,
            "--events-file", str(tmp_path / f"{name}.events"),
            EXAMPLE, "--epochs", "100000", "--no-checkpoint", "--dataset-size", "512", "--batch-size", "32",
            "--hidden", "16384", "--step-sleep", "0.05"],
            name=name, env={"TRAIN_COMPUTE_SLEEP": str(SLOW_COMPUTE_S)} if name == "nc" else {}))
    return started


def training_at_world(etcd_server: EtcdServer, job: str, world: int) -> Optional[Dict[str, Any]]:
    doc = status(etcd_server, job)
    if not doc or doc.get("world_size") != world:
        return None
    ms = members(doc)
    ok = all(m["status"] == "Active" and (m.get("progress") or {}).get("round") == doc["round"] for m in ms.values())
    return doc if ok and len(ms) == world else None


def test_a_slowed_node_is_flagged_in_status_and_nobody_else(agents, etcd_server: EtcdServer, job_id: str,
                                                            tmp_path: Path) -> None:
    na, nb, nc = start_three(agents, etcd_server, job_id, "warn", tmp_path)
    wait_until(lambda: training_at_world(etcd_server, job_id, 3), 180, "3 nodes training", interval=1.0)
    t0 = time.monotonic()
    doc = wait_until(lambda: (lambda d: d if members(d).get("nc", {}).get("straggler") else None)(
        status(etcd_server, job_id)), FLAG_WITHIN_S, "node nc flagged as a straggler in status --json", interval=1.0)
    flagged_after = time.monotonic() - t0
    ms = members(doc)
    assert not ms["na"]["straggler"] and not ms["nb"]["straggler"], ms
    assert ms["nc"]["straggler_ratio"] >= 1.2
    assert doc["stragglers"]["drain"] == []  # warn only
    print(f"flagged {flagged_after:.1f} s after all 3 were seen training, ratio {ms['nc']['straggler_ratio']}")
    wait_until(lambda: any(e["event"] == "straggler" and e["straggler"] for e in events_of(tmp_path / "nc.events")),
               10, "a straggler event from nc's agent (it reads the flag on its next tick)", interval=0.2)
    for a in (na, nb, nc):
        a.signal(signal.SIGTERM)
    assert [a.wait(120) for a in (na, nb, nc)] == [143, 143, 143]


def test_drain_takes_the_straggler_out_and_the_job_goes_on_at_world_2(agents, etcd_server: EtcdServer, job_id: str,
                                                                      tmp_path: Path) -> None:
    na, nb, nc = start_three(agents, etcd_server, job_id, "drain", tmp_path)
    code = nc.wait(180 + FLAG_WITHIN_S)  # it starts slow: it may be drained before a poll here sees it train
    assert code == 6, nc.stderr()[-3000:]
    assert "drained as a straggler" in nc.stderr()
    nc_events = events_of(tmp_path / "nc.events")
    assert any(e["event"] == "round_formed" and e["world_size"] == 3 for e in nc_events), nc_events
    doc = wait_until(lambda: training_at_world(etcd_server, job_id, 2), 120, "the job training at world 2",
                     interval=1.0)
    assert set(members(doc)) == {"na", "nb"}
    assert [(e["node_id"], e["why"]) for e in doc["excluded"]] == [("nc", "straggler")]
    assert any(e["event"] == "drained" for e in nc_events)
    step = members(doc)["na"]["progress"]["step"]
    wait_until(lambda: members(status(etcd_server, job_id))["na"]["progress"]["step"] > step, 60,
               "training to go on at world 2", interval=1.0)
    for a in (na, nb):
        a.signal(signal.SIGTERM)
    assert [a.wait(120) for a in (na, nb)] == [143, 143]


def test_check_passes_on_this_machine_and_prints_its_table(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "elasticrun", "check", "--ckpt-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "node check: passed"
    assert lines[1].split() == ["check", "figure", "threshold", "result", "detail"]
    for name in ("cpu matmul (1 thread)", "checkpoint dir write", "shm free (/dev/shm)", "all-reduce gloo ×2"):
        row = next(line for line in lines if line.startswith(name))
        assert " pass" in row, row
    assert not any(" fail" in line for line in lines[2:]), done.stdout
