"""Shared helpers for the checkpoint tests: spawning gloo worker groups and CLI runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

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
    return _collect(procs, timeout)


def _collect(procs: List[subprocess.Popen], timeout: float) -> List[subprocess.CompletedProcess]:
    """Every process's exit and output, all within ``timeout``; any still running then is killed."""
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


def run_nodes(code: str, args: Sequence[str], dirs: Sequence[Path], timeout: float = 180,
              env_of: Optional[Sequence[Dict[str, str]]] = None) -> List[subprocess.CompletedProcess]:
    """``python -c code *args`` once per entry of ``dirs`` (that rank's node's snapshot directory:
    ranks sharing one form a node), in one gloo group (env://), ranks in order; ``env_of[rank]``
    is added to that rank's environment."""
    from elasticrun.store.server import free_port

    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    procs = []
    for rank, d in enumerate(dirs):
        local = sum(1 for x in dirs[:rank] if x == d)
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(len(dirs)), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   LOCAL_RANK=str(local), OMP_NUM_THREADS="1", ELASTICRUN_SNAPSHOT_DIR=str(d),
                   **(env_of[rank] if env_of else {}))
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return _collect(procs, timeout)


def node_results(outs: List[subprocess.CompletedProcess]) -> List[Dict[str, Any]]:
    """The ``RESULT <json>`` line of every process (each must have exited 0 and printed one)."""
    assert all(o.returncode == 0 for o in outs), [o.stdout[-3000:] for o in outs]
    res = [json.loads(ln[7:]) for o in outs for ln in o.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(res) == len(outs), [o.stdout[-3000:] for o in outs]
    return res


def cli(*args: str, env: Optional[Dict[str, str]] = None, input: Optional[str] = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m elasticrun ckpt ARGS`` with captured text output."""
    return subprocess.run(
        [sys.executable, "-m", "elasticrun", "ckpt", *args], capture_output=True, text=True, cwd=str(REPO),
        env=child_env({"COLUMNS": "200", **(env or {})}), input=input, timeout=timeout,
    )


def reference_wordsum(data: bytes) -> str:
    """``wordsum`` of ``data`` by its definition (elasticrun/checkpoint/wordsum.py), one word at a time."""
    a = b = 0
    for i in range(0, len(data), 8):
        word = int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little")
        a += word
        b += (i // 4096 + 1) * word
    mask = (1 << 64) - 1
    return f"{a & mask:016x}{b & mask:016x}"
