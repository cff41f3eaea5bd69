"""Helpers for the launcher tests (tests/test_launch_*.py, tests/test_cli_run.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from elasticrun.job.keys import JobKeys
from elasticrun.store.client import EtcdStore

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPTS = REPO / "tests" / "scripts"
REPORT_ENV = str(SCRIPTS / "report_env.py")
ECHO = str(SCRIPTS / "echo_worker.py")
_TRACEBACK = "Traceback (most recent call last)"


def reports(out_dir: Path) -> List[Dict]:
    """Every JSON record ``report_env.py`` wrote into ``out_dir``, sorted by (round, rank)."""
    rows = []
    for path in out_dir.glob("rank*-r*-round*.json"):
        with open(path) as f:
            rows.append(json.load(f))
    return sorted(rows, key=lambda r: (int(r["ELASTICRUN_ROUND"]), int(r["RANK"])))


def node_ids(store: EtcdStore, job: str) -> List[str]:
    """Node ids registered in etcd for ``job`` (``/elasticrun/<job>/nodes/<id>``)."""
    prefix = JobKeys(job).nodes
    kvs, _ = store.get_prefix(prefix)
    return sorted(kv.key[len(prefix):] for kv in kvs)


def worker_lines(text: str, tag: str) -> List[str]:
    """Console lines of the form ``[node/rank]:<tag>...`` in an agent's output."""
    return [ln for ln in text.splitlines() if re.match(rf"^\[[^\]/]+/\d+\]:{re.escape(tag)}", ln)]


def run_cli(
    args: Sequence[str], timeout: float = 60.0, env: Optional[Dict[str, Optional[str]]] = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run ``python -m elasticrun ARGS`` to completion and return it (text output)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run(
        [sys.executable, "-m", "elasticrun", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=str(cwd),
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, no traceback, and the ``elasticrun: error:`` line contains every needle."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"expected a failure, got exit 0:\n{out}"
    assert _TRACEBACK not in out, f"traceback shown to the user:\n{out}"
    errors = [ln for ln in out.splitlines() if ln.startswith("elasticrun: error:")]
    assert len(errors) == 1, f"expected exactly one error line:\n{out}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def processes_with(marker: str) -> List[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def elapsed(start: float) -> float:
    return time.monotonic() - start


def wait_agents(started: Sequence, timeout: float) -> List[int]:
    """Exit codes of every agent (conftest.Agent) within one shared deadline.

    On timeout, fail with every agent's output and its live descendants, so that a hang is diagnosable.
    """
    deadline = time.monotonic() + timeout
    codes = []
    for a in started:
        try:
            codes.append(a.proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            report = []
            for b in started:
                kids = []
                for p in b.descendants():
                    try:
                        kids.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[-120:]}")
                    except psutil.NoSuchProcess:
                        pass
                report.append(
                    f"=== agent {b.name} (exit {b.proc.poll()}) children:\n" + "\n".join(kids)
                    + f"\n--- stdout\n{b.stdout()[-3000:]}\n--- stderr\n{b.stderr()[-5000:]}"
                )
            raise AssertionError(f"agent {a.name} still running after {timeout:.0f}s\n" + "\n".join(report)) from None
    return codes


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead; so does one that exits while we look)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
