"""A worker crash recovered in place: the other nodes keep their workers, the crashed rank rejoins.

Real agents, a real etcd, real gloo workers (tests/scripts/inplace_worker.py, which hands a step
whose collective failed to ``InPlace.recover``). Three nodes × one worker; rank 1's worker is
SIGKILLed: its agent reports the failure flagged recoverable, the other agents keep their workers
(blocked in the broken collective, then waiting in ``recover``), the leader forms a ``Restart``
round that re-forms them in place, and the crashed node's agent starts a replacement that joins
as a newcomer and receives the state. The crash uses a restart (``--max-restarts``) and shows in
the failure rows and the ``restart`` event (``recovery: in_place``). When the replacement dies
while receiving the state, the round takes today's restart path (every worker restarts). On a host
with two or more GPUs (marked ``gpu``) the SIGKILL also runs over NCCL with DDP, one GPU per node.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Dict, Sequence

import pytest
import torch
import torch.distributed as dist

from elasticrun.job.inplace import RECOVERABLE
from elasticrun.job.keys import JobKeys

from helpers.inplace import inplace_args, log_rows, log_steps, steps_by_process
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DATASET = 600  # 3 ranks x 2 samples: 100 steps at world 3
HANG_TIMEOUT = 5
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # read at collection: the host's GPUs
NCCL = dist.is_available() and dist.is_nccl_available()


def _start(agents, endpoint: str, job: str, tmp: Path, env: Dict[str, str], extra: Dict[str, Dict[str, str]],
           flags: Sequence[str] = ()):
    """Nodes A, B, C at group ranks 0, 1, 2 (fixed: B is the one whose worker is killed)."""
    return {n: agents(inplace_args(endpoint, job, n, "3", extra=[
        "--max-restarts", "2", "--node-rank", str(i), "--events-file", str(tmp / f"events-{n}.jsonl"), *flags]),
        name=n, env={**env, **extra.get(n, {})}) for i, n in enumerate("ABC")}


def _all_opted_in(etcd, keys: JobKeys) -> bool:
    """Every node's record says its workers opted in (a crash before that takes the restart path)."""
    records = [etcd.get_json(keys.node(n)) for n in "ABC"]
    return all(r is not None and r.get("inplace") is True for r in records)


def _worker_of(log: Path, rank: int, round_: int = 0) -> int:
    return next(r["pid"] for r in log_steps(log) if r["rank"] == rank and r["round"] == round_)


def test_a_killed_worker_is_recovered_in_place(etcd_server, etcd, job_id, agents, tmp_path):
    """Also: ``--hang-timeout`` sees no hang while the survivors wait for the replacement (B's workers
    sleep longer than the hang timeout before ``et.init``; the survivors' step stands still meanwhile)."""
    log, fast = tmp_path / "steps.jsonl", tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": str(DATASET), "INPLACE_PACE": "0.05",
           "INPLACE_FAST_FILE": str(fast), "INPLACE_HEARTBEAT": "1"}
    keys = JobKeys(job_id)
    slow = {"B": {"INPLACE_START_DELAY": str(HANG_TIMEOUT + 2)}}
    a = _start(agents, etcd_server.endpoint, job_id, tmp_path, env, slow, ["--hang-timeout", str(HANG_TIMEOUT)])
    wait_until(lambda: sum(r["world"] == 3 for r in log_steps(log)) >= 12, 150, "steps at world size 3")
    wait_until(lambda: _all_opted_in(etcd, keys), 60, "every node offering in-place re-forming")
    pids = {rank: _worker_of(log, rank) for rank in range(3)}
    crashed = "B"
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: any(r["round"] >= 1 and r["world"] == 3 and r["rank"] == 1 for r in log_steps(log)), 150,
               "the crashed rank training again")
    fast.touch()
    for n in "ABC":
        assert a[n].wait(120) == 0, a[n].output()
    topo = etcd.get_json(keys.topology)
    assert topo["round"] == 1 and topo["restart_count"] == 1, "one round for the crash, charged as a restart"
    assert sorted(topo["inplace"]) == sorted(set("ABC") - {crashed}), "the other nodes re-formed in place"
    rows = etcd.get_json(keys.failure(0, crashed))
    assert rows[0]["signal"] == "SIGKILL" and rows[0][RECOVERABLE] is True, rows
    steps = log_steps(log)
    # The survivors kept their processes; the crashed rank runs in a new one.
    later = {r["rank"]: r["pid"] for r in steps if r["round"] == 1}
    assert later[0] == pids[0] and later[2] == pids[2] and later[1] != pids[1], (pids, later)
    # No step twice: consecutive per process, rank 0's steps are 1..N once each; no sample twice.
    by_pid = steps_by_process(steps)
    rank0 = [r["step"] for r in steps if r["rank"] == 0]
    assert rank0 == list(range(1, len(rank0) + 1))
    seen = [i for r in steps for i in r["idx"]]
    assert len(seen) == len(set(seen)), "a sample trained twice"
    # The killed worker may die after a step's last collective but before its log line: that step's
    # two samples of rank 1 were trained (the survivors' update has them) but are not logged.
    assert len(set(range(DATASET)) - set(seen)) <= 2
    assert by_pid[later[1]][0] == max(r["step"] for r in steps if r["round"] == 0) + 1, "the replacement got the step"
    for step in {r["step"] for r in steps}:
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws), f"step {step}: ranks differ"
    pause = min(r["t"] for r in steps if r["round"] == 1 and r["rank"] == 0) - max(
        r["t"] for r in steps if r["round"] == 0 and r["rank"] == 0)
    print(f"survivors' pause at the crash (last step before → first after, incl. the replacement's start): "
          f"{pause:.2f} s")
    back = [r for r in log_rows(log) if ("recovered" in r or "reformed" in r) and r.get("round") == 1]
    assert sorted(r["pid"] for r in back) == sorted([pids[0], pids[2]]), back
    events = [json.loads(line) for line in (tmp_path / f"events-{crashed}.jsonl").read_text().splitlines()]
    assert [e.get("recovery") for e in events if e["event"] == "restart"] == ["in_place"], events
    survivor = next(n for n in "ABC" if n != crashed)
    assert "re-forming in place" in a[survivor].stderr()
    assert not any("has not advanced" in a[n].stderr() for n in "ABC"), "no hang verdict during the recovery"


def test_a_replacement_that_dies_receiving_the_state_falls_back_to_restart(etcd_server, etcd, job_id, agents,
                                                                           tmp_path):
    log, fast = tmp_path / "steps.jsonl", tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": str(DATASET), "INPLACE_PACE": "0.05",
           "INPLACE_FAST_FILE": str(fast), "INPLACE_JOIN_TIMEOUT": "15"}
    keys = JobKeys(job_id)
    # Every worker B's agent starts dies inside the state's broadcast if it is a newcomer: B's first
    # worker (round 0 is no re-form) trains normally; its replacement dies (exit 3).
    a = _start(agents, etcd_server.endpoint, job_id, tmp_path, env, {"B": {"INPLACE_DIE": "sync"}})
    wait_until(lambda: sum(r["world"] == 3 for r in log_steps(log)) >= 12, 150, "steps at world size 3")
    wait_until(lambda: _all_opted_in(etcd, keys), 60, "every node offering in-place re-forming")
    crashed = "B"
    first = {r["pid"] for r in log_steps(log)}
    os.kill(_worker_of(log, 1), signal.SIGKILL)
    wait_until(lambda: etcd.get_json(keys.topology)["round"] >= 2, 150, "a round after the failed recovery")
    wait_until(lambda: any(r["round"] >= 2 and r["pid"] not in first for r in log_steps(log)), 150,
               "the restart round training")
    fast.touch()
    for n in "ABC":
        assert a[n].wait(120) == 0, a[n].output()
    survivor = next(n for n in "ABC" if n != crashed)
    assert "re-forming in place" in a[survivor].stderr(), "round 1 tried to recover in place"
    topo = etcd.get_json(keys.topology)
    assert topo["round"] == 2 and not topo.get("inplace"), "the fallback restarts every worker"
    assert topo["restart_count"] == 1, "the crash is charged once; the failed recovery is free"
    assert not {r["pid"] for r in log_steps(log) if r["round"] == 2} & first, "every worker restarted"


def test_a_lost_node_is_recovered_in_place_at_the_smaller_size(etcd_server, etcd, job_id, agents, tmp_path):
    """SIGKILL of node B's whole process tree (agent and worker): its lease expires (3 s), the round ends
    as a ScaleDown; A and C keep their workers (their collectives with B's dead worker failed, they
    wait in ``recover``) and re-form at world 2. No restart is used; no step or sample runs twice."""
    log, fast = tmp_path / "steps.jsonl", tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": str(DATASET), "INPLACE_PACE": "0.05",
           "INPLACE_FAST_FILE": str(fast), "INPLACE_TIMEOUT": "30"}
    keys = JobKeys(job_id)
    a = _start(agents, etcd_server.endpoint, job_id, tmp_path, env, {}, ["--nnodes", "2:3"])
    wait_until(lambda: sum(r["world"] == 3 for r in log_steps(log)) >= 12, 150, "steps at world size 3")
    wait_until(lambda: _all_opted_in(etcd, keys), 60, "every node offering in-place re-forming")
    # Round 0 may have formed at world 2 before C registered (a loaded host), C then joining in place.
    full = max(r["round"] for r in log_steps(log) if r["world"] == 3)
    pids = {rank: _worker_of(log, rank, full) for rank in range(3)}
    for proc in [*a["B"].descendants(), a["B"].proc]:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: sum(r["world"] == 2 and r["round"] > full for r in log_steps(log)) >= 6, 150,
               "steps at world size 2")
    fast.touch()
    for n in "AC":
        assert a[n].wait(120) == 0, a[n].output()
    topo = etcd.get_json(keys.topology)
    assert sorted(topo["inplace"]) == ["A", "C"] and topo["restart_count"] == 0, topo
    steps = log_steps(log)
    assert {r["pid"] for r in steps if r["round"] > full} == {pids[0], pids[2]}, "A and C kept their workers"
    steps_by_process(steps)
    seen = [i for r in steps for i in r["idx"]]
    assert len(seen) == len(set(seen)), "a sample trained twice"
    assert len(set(range(DATASET)) - set(seen)) <= 2, "at most the lost worker's last, unlogged step"


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2 or not NCCL, reason=f"a crash over NCCL needs one CUDA GPU per node "
                                                  f"(this host: {GPUS} GPUs, NCCL {'yes' if NCCL else 'no'})")
def test_a_killed_worker_is_recovered_in_place_over_nccl(etcd_server, etcd, job_id, agents, tmp_path):
    """The SIGKILL over NCCL with DDP, one GPU per simulated node (``CUDA_VISIBLE_DEVICES=<i>``; 2 or 3
    nodes): the survivors' agents say the round broke, the survivors' watch aborts their communicators
    (a survivor whose all-reduce waits on the dead peer on the device is woken, not left to NCCL's
    timeout), they re-form with B's replacement and no step runs twice."""
    n = min(GPUS, 3)
    nodes = "ABC"[:n]
    log, fast = tmp_path / "steps.jsonl", tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": str(n * 2 * 400), "INPLACE_PACE": "0.02",
           "INPLACE_FAST_FILE": str(fast), "INPLACE_DDP": "1", "INPLACE_JOIN_TIMEOUT": "120"}
    keys = JobKeys(job_id)
    a = {x: agents(inplace_args(etcd_server.endpoint, job_id, x, str(n), extra=[
        "--max-restarts", "2", "--node-rank", str(i), "--events-file", str(tmp_path / f"events-{x}.jsonl")]),
        name=x, env={**env, "CUDA_VISIBLE_DEVICES": str(i)}) for i, x in enumerate(nodes)}
    wait_until(lambda: sum(r["world"] == n for r in log_steps(log)) >= 6 * n, 150, f"steps at world size {n}")
    wait_until(lambda: all((etcd.get_json(keys.node(x)) or {}).get("inplace") is True for x in nodes), 60,
               "every node offering in-place re-forming")
    pids = {rank: _worker_of(log, rank) for rank in range(n)}
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: any(r["round"] >= 1 and r["world"] == n and r["rank"] == 1 for r in log_steps(log)), 150,
               "the crashed rank training again")
    fast.touch()
    for x in nodes:
        assert a[x].wait(120) == 0, a[x].output()
    topo = etcd.get_json(keys.topology)
    assert topo["round"] == 1 and sorted(topo["inplace"]) == [x for x in nodes if x != "B"], topo
    steps = log_steps(log)
    assert {r["backend"] for r in steps} == {"nccl"}, "every step ran over NCCL"
    later = {r["rank"]: r["pid"] for r in steps if r["round"] == 1}
    assert all(later[r] == pids[r] for r in range(n) if r != 1) and later[1] != pids[1], (pids, later)
    steps_by_process(steps)
    rank0 = [r["step"] for r in steps if r["rank"] == 0]
    assert rank0 == list(range(1, len(rank0) + 1)), "no step twice, none skipped"
    seen = [i for r in steps for i in r["idx"]]
    assert len(seen) == len(set(seen)), "a sample trained twice"
    for step in {r["step"] for r in steps}:  # no partial all-reduce reached any model
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws), f"step {step}: ranks differ"
    back = [r for r in log_rows(log) if ("recovered" in r or "reformed" in r) and r.get("round") == 1]
    assert sorted(r["pid"] for r in back) == sorted(pids[r] for r in range(n) if r != 1), back
