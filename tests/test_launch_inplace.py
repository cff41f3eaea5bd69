"""In-place re-forming with real agents, real etcd and real gloo workers (tests/scripts/inplace_worker.py).

A join (2 → 3) and a graceful leave (3 → 2) keep the survivors' worker processes, run no step
twice and see every sample once; a newcomer that dies while receiving the state, or a survivor
that dies inside its re-form, makes the round fail and the job restarts as today, then completes.
On a GPU host (marked ``gpu``) the join and the leave run over NCCL, one GPU per simulated node.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from elasticrun.job.keys import JobKeys

from helpers.inplace import log_rows, log_steps
from helpers.procs import SCRIPTS, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # read at collection: the host's GPUs
NCCL = dist.is_available() and dist.is_nccl_available()
EXIT_DELAY_S = 8.0  # how long the leaver's worker takes to exit in the graceful-leave test


def _args(endpoint: str, job: str, node: str, max_restarts: int = 2, nnodes: str = "2:3",
          shutdown_timeout: float = 2) -> List[str]:
    return ["--nnodes", nnodes, "--max-restarts", str(max_restarts), "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--node-id", node, "--heartbeat-timeout", "3",
            "--stability-window", "0.5", "--shutdown-timeout", str(shutdown_timeout),
            str(SCRIPTS / "inplace_worker.py")]


def _at(log: Path, world: int, n: int, after_round: int = -1) -> bool:
    return sum(1 for r in log_steps(log) if r["world"] == world and r["round"] > after_round) >= n


def _pause(log: Path, old_round: int, new_round: int) -> float:
    """The survivors' pause: per worker, its last step in ``old_round`` → its first in ``new_round``; the longest."""
    last: Dict[int, float] = {}
    first: Dict[int, float] = {}
    for r in log_steps(log):
        if r["round"] == old_round:
            last[r["pid"]] = max(last.get(r["pid"], 0.0), r["t"])
        elif r["round"] == new_round:
            first.setdefault(r["pid"], r["t"])
    return max(first[p] - last[p] for p in first.keys() & last.keys())


def _check_kept_in_place(log: Path, steps: List[dict], nodes: int) -> Dict[int, List[dict]]:
    """A join then a graceful leave of the last of ``nodes`` nodes, every change in place: one worker
    process per node for the whole job, no step twice or skipped, the newcomer got the step, every
    sample once, ranks agree per step, both world sizes trained, and every survivor re-formed at both
    changes. Returns the step records by worker pid."""
    by_pid: Dict[int, List[dict]] = {}
    for r in steps:
        by_pid.setdefault(r["pid"], []).append(r)
    assert len(by_pid) == nodes, f"one worker process per node, nothing restarted: {sorted(by_pid)}"
    for rows in by_pid.values():
        seq = [r["step"] for r in rows]
        assert seq == list(range(seq[0], seq[0] + len(seq))), "no step twice, none skipped"
    newcomers = [rows[0] for rows in by_pid.values() if rows[0]["round"] > 0]
    assert len(newcomers) == 1
    assert newcomers[0]["step"] == max(r["step"] for r in steps if r["round"] == 0) + 1, "the newcomer got the step"
    assert sorted(i for r in steps for i in r["idx"]) == list(range(2000)), "every sample exactly once"
    for step in {r["step"] for r in steps}:
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws), f"step {step}: ranks differ"
    assert {r["world"] for r in steps} == {nodes - 1, nodes}
    pauses = [r["reformed"] for r in log_rows(log) if "reformed" in r]
    assert len(pauses) == 2 * (nodes - 1), pauses
    return by_pid


def test_join_and_graceful_leave_reform_in_place(etcd_server, etcd, job_id, agents, tmp_path):
    log = tmp_path / "steps.jsonl"
    fast = tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "2000", "INPLACE_PACE": "0.1", "INPLACE_FAST_FILE": str(fast)}
    keys = JobKeys(job_id)
    # B, the leaver, has a worker that takes EXIT_DELAY_S to exit once told to stop (and an agent that waits
    # for it): the survivors' pause shows whether they waited for that exit.
    a = {"A": agents(_args(etcd_server.endpoint, job_id, "A"), name="A", env=env),
         "B": agents(_args(etcd_server.endpoint, job_id, "B", shutdown_timeout=3 * EXIT_DELAY_S), name="B",
                     env={**env, "INPLACE_EXIT_DELAY": str(EXIT_DELAY_S)})}
    wait_until(lambda: _at(log, 2, 6), 150, "steps at world size 2")
    a["C"] = agents(_args(etcd_server.endpoint, job_id, "C"), name="C", env=env)  # same flags as A, B
    wait_until(lambda: _at(log, 3, 6), 150, "steps at world size 3")
    join_round = etcd.get_json(keys.topology)
    assert sorted(join_round["inplace"]) == ["A", "B"], "the round record names the survivors that re-form in place"
    a["B"].signal(signal.SIGTERM)  # graceful leave of the middle rank
    wait_until(lambda: _at(log, 2, 6, after_round=join_round["round"]), 150, "steps at world size 2 again")
    leave_round = etcd.get_json(keys.topology)
    assert sorted(leave_round["inplace"]) == ["A", "C"]
    join_pause = _pause(log, 0, join_round["round"])
    leave_pause = _pause(log, join_round["round"], leave_round["round"])
    print(f"survivors' pause (incl. the script's 0.1 s sleep): join {join_pause:.2f} s, leave {leave_pause:.2f} s")
    # The leaver's agent leaves the job before its worker has exited, so the survivors do not wait for
    # that exit (EXIT_DELAY_S here) nor for its lease to expire (the 3 s heartbeat timeout): their pause is
    # the re-form's alone.
    assert leave_pause < 3.0, f"graceful-leave pause {leave_pause:.2f} s: the survivors waited"
    fast.touch()  # the rest of the epoch without pauses
    for n in "AC":
        assert a[n].wait(120) == 0, a[n].output()
    steps = log_steps(log)
    _check_kept_in_place(log, steps, nodes=3)  # A, B re-formed at the join; A, C at the leave
    assert "re-formed in place" in a["A"].stderr()


@pytest.mark.parametrize("failure", ["newcomer-sync", "survivor-reform"])
def test_failed_reform_falls_back_to_restart(etcd_server, etcd, job_id, agents, tmp_path, failure):
    log = tmp_path / "steps.jsonl"
    fast = tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "2000", "INPLACE_PACE": "0.1", "INPLACE_JOIN_TIMEOUT": "15",
           "INPLACE_FAST_FILE": str(fast)}
    die = {"C": "sync", "B": "reform:0"}["C" if failure == "newcomer-sync" else "B"]
    dying = "C" if failure == "newcomer-sync" else "B"
    # --max-restarts 0 (torchrun's default): a failed re-form falls back without using a restart.
    a = {n: agents(_args(etcd_server.endpoint, job_id, n, 0), name=n,
                   env={**env, **({"INPLACE_DIE": die} if n == dying else {})}) for n in "AB"}
    wait_until(lambda: _at(log, 2, 4), 150, "steps at world size 2")
    survivors = {r["pid"] for r in log_steps(log)}
    a["C"] = agents(_args(etcd_server.endpoint, job_id, "C", 0), name="C",
                    env={**env, **({"INPLACE_DIE": die} if dying == "C" else {})})
    # The newcomer dies receiving the state, or survivor B inside its re-form (after leaving the old
    # group): the round fails, every worker restarts (new processes), the job completes.
    wait_until(lambda: any(r["world"] == 3 and r["pid"] not in survivors and r["round"] >= 2 for r in log_steps(log)),
               150, "a restarted round at world size 3")
    fast.touch()
    for ag in a.values():
        assert ag.wait(120) == 0, ag.output()
    topo = etcd.get_json(JobKeys(job_id).topology)
    assert not topo.get("inplace"), "the restart round re-forms nothing in place"
    assert topo["restart_count"] == 0, "a failed re-form is not charged to the restart budget"
    # A sees the failure as the round's (flagged by another node) or as its own worker's exit 75,
    # whichever comes first: both end the round.
    assert "worker failure" in a["A"].stderr() or "failed (75)" in a["A"].stderr()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2 or not NCCL, reason=f"in-place re-forming over NCCL needs 2 CUDA GPUs and NCCL "
                                                  f"(this host: {GPUS} GPUs, NCCL {'yes' if NCCL else 'no'})")
def test_join_and_graceful_leave_reform_in_place_over_nccl(etcd_server, etcd, job_id, agents, tmp_path):
    """The join and the graceful leave over NCCL, with DDP rebuilt at every re-form. Each simulated
    node's agent sees one GPU (``CUDA_VISIBLE_DEVICES=<i>``: its LOCAL_RANK 0 is GPU i) and picks
    nccl by itself. Two GPUs: 1 → 2 → 1 nodes (the newcomer leaves); three or more: 2 → 3 → 2
    (the middle rank leaves)."""
    n = min(GPUS, 3)
    nodes = "ABC"[:n]
    leaver = nodes[1]
    log = tmp_path / "steps.jsonl"
    fast = tmp_path / "fast"
    env = {"INPLACE_LOG": str(log), "INPLACE_DATASET": "2000", "INPLACE_PACE": "0.1", "INPLACE_FAST_FILE": str(fast),
           "INPLACE_DDP": "1"}
    keys = JobKeys(job_id)

    def start(i: int):
        return agents(_args(etcd_server.endpoint, job_id, nodes[i], nnodes=f"{n - 1}:{n}"), name=nodes[i],
                      env={**env, "CUDA_VISIBLE_DEVICES": str(i)})

    a = {nodes[i]: start(i) for i in range(n - 1)}
    wait_until(lambda: _at(log, n - 1, 3 * (n - 1)), 150, f"steps at world size {n - 1}")
    a[nodes[-1]] = start(n - 1)
    wait_until(lambda: _at(log, n, 3 * n), 150, f"steps at world size {n}")
    join_round = etcd.get_json(keys.topology)
    assert sorted(join_round["inplace"]) == list(nodes[:-1]), "the survivors re-form in place"
    a[leaver].signal(signal.SIGTERM)
    wait_until(lambda: _at(log, n - 1, 3 * (n - 1), after_round=join_round["round"]), 150,
               f"steps at world size {n - 1} again")
    leave_round = etcd.get_json(keys.topology)
    assert sorted(leave_round["inplace"]) == [x for x in nodes if x != leaver]
    fast.touch()
    for x in nodes:
        if x != leaver:
            assert a[x].wait(120) == 0, a[x].output()
    steps = log_steps(log)
    assert {r["backend"] for r in steps} == {"nccl"}, "every step ran over NCCL"
    by_pid = _check_kept_in_place(log, steps, nodes=n)  # the survivors re-formed at the join, then at the leave
    gpus = {pid: {r["gpus"] for r in rows} for pid, rows in by_pid.items()}
    assert sorted(g for s in gpus.values() for g in s) == [str(i) for i in range(n)], f"one GPU per node: {gpus}"
    pauses = [r["reformed"] for r in log_rows(log) if "reformed" in r]
    assert "re-formed in place" in a["A"].stderr()
    print(f"NCCL in-place re-form pauses (s): {sorted(pauses)}")
