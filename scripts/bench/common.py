"""What the benches share: the ``summary`` rows of their JSON (what scripts/perf/perf_report.py puts in the
table), the command line they show for a rerun, ending a bench's processes by the marker in their
environment, and ``elasticrun`` imported from this tree (the repository goes first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import psutil

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"  # the example the benches run as a real training job
# torchrun "at its best": its c10d rendezvous with the shortest timeouts that still hold on a loaded machine
TORCHRUN_TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
if str(REPO) not in sys.path:  # the benches import elasticrun as in this tree
    sys.path.insert(0, str(REPO))


def summary_row(metric: str, elasticrun: float, alternative: str, alt_value: Optional[float], unit: str = "s",
                better: str = "lower", device: str = "cpu", command: str = "", **extra: Any) -> Dict[str, Any]:
    """One row; its ratio is above 1 where elasticrun is ahead: alternative ÷ elasticrun for a figure where lower
    is better, elasticrun ÷ alternative for one where higher is (None without both values); ``extra``: more
    fields of the bench's own."""
    ratio = None
    if elasticrun and alt_value:
        ratio = round(alt_value / elasticrun if better == "lower" else elasticrun / alt_value, 3)
    return {"metric": metric, "elasticrun": round(elasticrun, 4), "alternative": alternative,
            "alt_value": None if alt_value is None else round(alt_value, 4), "unit": unit, "better": better,
            "ratio": ratio, "device": device, "command": command, **extra}


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned (the rest are left)."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in [header, rule, *rows])


def shown_command(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """``python scripts/bench/SCRIPT ARGS`` as this bench was run (``argv``: its arguments, default sys.argv)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"scripts/bench/{Path(script).name}", *args])


def tagged_processes(var: str, tag: str) -> List[psutil.Process]:
    """Every live process whose environment carries ``var=tag`` (this run's, and only this run's)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(var) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def kill_all(procs: List[psutil.Process], timeout: float = 5) -> None:
    """SIGCONT then SIGKILL each process (a stopped one must not block cleanup) and reap what can be reaped."""
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=timeout)


def tree(pids: Iterable[int]) -> List[psutil.Process]:
    """Each live process of ``pids`` and every process under it."""
    found: List[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            found += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def kill_tree(pids: Iterable[int], timeout: float = 10) -> None:
    """SIGKILL each process of ``pids`` and everything below it (workers may sit in their own sessions)."""
    kill_all(tree(pids), timeout)


def interrupt_on(*signals: int) -> None:
    """Turn each of ``signals`` into KeyboardInterrupt, so that the cleanup of a Ctrl-C runs for them too."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in signals:
        signal.signal(sig, interrupt)


def kill_and_reap(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL the launchers ``procs`` and everything below them, and reap them."""
    kill_tree(p.pid for p in procs)
    for p in procs:
        p.wait()


def stop(procs: Sequence[subprocess.Popen], timeout: float = 60.0) -> List[Optional[int]]:
    """SIGTERM every live launcher of ``procs`` (as a user's Ctrl-C would), wait up to ``timeout`` s in all, then
    SIGKILL what is left with everything below it; their exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline, codes = time.monotonic() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_tree([p.pid])
            codes.append(p.wait())
    return codes


def write_json(path: Any, doc: Any) -> None:
    """Write a bench's JSON document to ``path`` (indented, one trailing newline)."""
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def gpu_count() -> int:
    """CUDA devices torch sees (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
