"""Jobs of ``tests/scripts/inplace_worker.py`` under real agents: agent command lines and its JSON log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

from helpers.procs import SCRIPTS


def inplace_args(endpoint: str, job: str, node: str, nnodes: str = "2:3", heartbeat: int = 3,
                 extra: Sequence[str] = ()) -> List[str]:
    """One node, one worker, ``--max-restarts 0``, short heartbeats; ``extra``: more agent flags."""
    return ["--nnodes", nnodes, "--max-restarts", "0", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", job, "--node-id", node, "--heartbeat-timeout", str(heartbeat), "--stability-window", "0.5",
            "--shutdown-timeout", "2", *extra, str(SCRIPTS / "inplace_worker.py")]


def log_rows(log: Path) -> List[dict]:
    """Every complete JSON line the workers wrote (steps, saves, re-forms)."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip().endswith("}")]


def log_steps(log: Path) -> List[dict]:
    """The step lines only."""
    return [r for r in log_rows(log) if "step" in r]



def steps_by_process(steps: List[dict]) -> Dict[int, List[int]]:
    """Each worker process's steps, asserted consecutive (no step ran twice in one process)."""
    by_pid: Dict[int, List[int]] = {}
    for r in steps:
        by_pid.setdefault(r["pid"], []).append(r["step"])
    for seq in by_pid.values():
        assert seq == list(range(seq[0], seq[0] + len(seq))), seq
    return by_pid
