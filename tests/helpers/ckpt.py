"""Shared helpers for the checkpoint tests: spawning gloo worker groups and CLI runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent.parent
WORKER = Path(__file__).resolve().parent.parent / "scripts" / "ckpt_dist_worker.py"


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def run_group(scenario: str, world: int, root: Path, tmp: Path, timeout: float = 120,
              env: Optional[Dict[str, str]] = None) -> List[subprocess.CompletedProcess]:
    """Run ``world`` worker processes of ``scenario`` in one gloo group; returns their results."""
    init_file = tmp / f"init-{scenario}-{time.monotonic_ns()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(world), str(init_file), str(root)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(env),
        )
        for rank in range(world)
    ]
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def cli(*args: str, env: Optional[Dict[str, str]] = None, input: Optional[str] = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m elasticrun ckpt ARGS`` with captured text output."""
    return subprocess.run(
        [sys.executable, "-m", "elasticrun", "ckpt", *args], capture_output=True, text=True, cwd=str(REPO),
        env=child_env({"COLUMNS": "200", **(env or {})}), input=input, timeout=timeout,
    )
