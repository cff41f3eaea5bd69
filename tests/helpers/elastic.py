"""Real elastic jobs of ``tests/scripts/train_loop.py`` (rank 0 logs every step with the world size
and round): agent command lines, the step log, the workers' pids."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

from helpers.launch import alive
from helpers.procs import SCRIPTS

HB = 3  # heartbeat timeout (lease TTL) used by these tests


def steps(out: Path) -> List[dict]:
    path = out / "steps.log"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        m = re.match(r"step (\d+) world (\d+) round (\d+) time ([\d.]+)", line)
        if m:
            rows.append({"step": int(m[1]), "world": int(m[2]), "round": int(m[3]), "time": float(m[4])})
    return rows


def end_job(out: Path) -> None:
    """The test saw what it waited for: the job ends after its next step (train_loop.py's ``end`` file)."""
    (out / "end").write_text("")


def first_step(out: Path, world: int) -> float:
    rows = [r for r in steps(out) if r["world"] == world]
    return rows[0]["time"] if rows else 0.0


def agent_args(
    endpoint: str, job: str, node: str, nnodes: str, out: Path, total: int, extra: List[str] = ()
) -> List[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
        "--node-id", node, "--heartbeat-timeout", str(HB), "--stability-window", "0.5", "--shutdown-timeout", "2",
        *extra, str(SCRIPTS / "train_loop.py"), str(out), str(total), "0.1",
    ]


def worker_pids(out: Path, node: str) -> List[int]:
    """Pids of every worker that ran on ``node`` (train_loop.py records them)."""
    return [int(p.name.rsplit("-", 1)[1]) for p in (out / "pids").glob(f"{node}-*")]


def all_gone(pids: List[int]) -> bool:
    return not any(alive(p) for p in pids)
