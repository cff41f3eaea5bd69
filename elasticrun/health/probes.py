"""The node check's measurements that need no torch: storage, the etcd round trip, and the child process
that runs :mod:`elasticrun.health.torchbench`. Each returns figures (or an error text), never a verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

WRITE_BYTES = 32 << 20  # written (and fsync'd) once per storage check
BENCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class StorageFigures:
    """Free space and fsync'd write speed of one directory."""

    path: str
    free_bytes: Optional[int]
    write_mbps: Optional[float]
    error: str = ""


def storage(path: str, nbytes: int = WRITE_BYTES) -> StorageFigures:
    """Write ``nbytes`` to a temporary file under ``path`` (fsync'd, then removed) and read the free space."""
    try:
        os.makedirs(path, exist_ok=True)
        free = shutil.disk_usage(path).free
    except OSError as err:
        return StorageFigures(path, None, None, f"cannot use {path}: {err.strerror or err}")
    block = os.urandom(1 << 20)
    fd, name = -1, ""
    try:
        fd, name = tempfile.mkstemp(prefix=".elasticrun-check-", dir=path)
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes >> 20)):
            os.write(fd, block)
        os.fsync(fd)
        seconds = time.perf_counter() - t0
        return StorageFigures(path, free, nbytes / max(seconds, 1e-9) / 1e6)
    except OSError as err:
        return StorageFigures(path, free, None, f"cannot write to {path}: {err.strerror or err}")
    finally:
        if fd >= 0:
            os.close(fd)
        if name:
            try:
                os.unlink(name)
            except OSError:
                pass


def round_trip_ms(call: Callable[[], Any], repeats: int = 5) -> float:
    """The median of ``repeats`` timings of ``call()`` (an etcd read), in milliseconds; raises what it raises."""
    times: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2]


def torch_figures(gpu: bool, allreduce: bool, timeout: float = BENCH_TIMEOUT_S) -> Dict[str, Any]:
    """Run :mod:`elasticrun.health.torchbench` in a child interpreter; its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "elasticrun.health.torchbench"]
    if not gpu:
        cmd.append("--no-gpu")
    if not allreduce:
        cmd.append("--no-allreduce")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the torch measurements took more than {timeout:g} s"}
    except OSError as err:
        return {"error": f"cannot run {sys.executable}: {err}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"torch measurements failed (exit {done.returncode}): {tail[:300]}"}
    try:
        doc = json.loads(lines[-1])
    except ValueError:
        return {"error": "torch measurements printed no JSON"}
    return doc if isinstance(doc, dict) else {"error": "torch measurements printed no JSON object"}


__all__ = ["StorageFigures", "round_trip_ms", "storage", "torch_figures"]
