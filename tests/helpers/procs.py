"""Processes in tests: condition waits with deadlines, agents as real processes, their environment.

Tests import them from ``helpers.procs``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, TypeVar

import psutil

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent.parent
SCRIPTS = REPO / "tests" / "scripts"


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def worker_env(extra: Optional[dict] = None) -> dict:
    """The test's environment plus ``extra``: ``CUDA_VISIBLE_DEVICES=""`` comes with it outside ``gpu``
    tests (tests/conftest.py); an ``extra`` that sets it (one GPU per simulated node) wins."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    # A value of None removes the variable (e.g. to check what the launcher sets by itself).
    return {k: v for k, v in env.items() if v is not None}


class Agent:
    """An ``elasticrun`` agent process with its output in files.

    ``program``: the command before ``args`` (default ``python -m elasticrun``; e.g. a script in
    tests/scripts that runs the agent with a fault injected)."""

    def __init__(self, args: List[str], log_dir: Path, name: str, env: Optional[dict] = None,
                 program: Optional[List[str]] = None) -> None:
        self.name = name
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        self._out = open(self.out_path, "wb")
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen(
            [*(program or [sys.executable, "-m", "elasticrun"]), *args],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            env=worker_env(env),
            cwd=str(REPO),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout() + self.stderr()

    def descendants(self) -> List[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still running after {timeout:.0f}s\n--- stdout\n{self.stdout()[-3000:]}"
                f"\n--- stderr\n{self.stderr()[-3000:]}"
            ) from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            kids = self.descendants()
            self.proc.kill()
            self.proc.wait(10)
            for k in kids:
                try:
                    k.kill()
                except psutil.NoSuchProcess:
                    pass
        self._out.close()
        self._err.close()


def no_process_with_marker(marker: str) -> bool:
    """True when no process has ``marker`` in its command line (e.g. a per-test output dir)."""
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in part for part in (p.info["cmdline"] or [])):
                return False
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return True


__all__ = ["Agent", "REPO", "SCRIPTS", "no_process_with_marker", "wait_until", "worker_env"]
