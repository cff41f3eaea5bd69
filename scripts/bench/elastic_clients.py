#!/usr/bin/env python
"""Training scripts ("clients") that ``scripts/bench/bench_elastic.py`` runs, and how to read their steps.

Clients (all CPU, gloo, launcher-agnostic):

``bench``    ``scripts/bench/elastic_train.py``: all-reduce one float, sleep 0.1 s, save its step to a file.
``plain``    this file run as a script: a tight all-reduce loop (64 Ki floats, no sleep) that never
             polls anything, handles no signal and keeps no state (it restarts at step 0).
             Rank 0 prints at most 20 step lines a second. Every rank prints ``BOOT`` when its
             script starts and ``PG`` once the process group is up, so the logs show where a
             restart spends its time.
``example``  ``examples/train.py`` (DDP, elastic sampler, checkpoint on SIGTERM, control polling).
``inplace``  ``scripts/bench/inplace_train.py``: the ``bench`` loop with ``elasticrun.train.InPlace``
             (survivors re-form in place at a join under elasticrun; restarts elsewhere).

A step line yields ``(step, world size, unix time)``; a client that prints no time gets the
time the benchmark read the line.

    python scripts/bench/elastic_clients.py plain        # under a launcher (torchrun env://)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STEP_RE = re.compile(r"STEP (\d+) WORLD (\d+) TIME (\d+(?:\.\d+)?)")
EXAMPLE_RE = re.compile(r"(?:^|\]:)step (\d+) loss \S+ world (\d+)")
MARK_RE = re.compile(r"elasticrun\[[^]]*\]: (joined job|round \d+ \(\w+\): world size)")
Step = Tuple[int, int, float]


@dataclass(frozen=True)
class Client:
    """One training script under test."""

    name: str

    def argv(self, out_dir: Path) -> List[str]:
        """The script and its arguments (after the launcher's own options)."""
        if self.name == "bench":
            return [str(HERE / "elastic_train.py"), str(out_dir)]
        if self.name == "inplace":
            return [str(HERE / "inplace_train.py"), str(out_dir)]
        if self.name == "plain":
            return [str(Path(__file__).resolve()), "plain"]
        return [str(REPO / "examples" / "train.py"), "--epochs", "1000000", "--ckpt-dir", str(out_dir / "ckpt"),
                "--ckpt-every", "0", "--step-sleep", "0.05"]

    def parse(self, line: str, read_at: float) -> List[Step]:
        """The steps that one output line reports."""
        if self.name == "example":
            m = EXAMPLE_RE.search(line)
            return [(int(m[1]), int(m[2]), read_at)] if m else []
        return [(int(m[1]), int(m[2]), float(m[3])) for m in STEP_RE.finditer(line)]


CLIENTS = {name: Client(name) for name in ("bench", "plain", "example", "inplace")}


class Node:
    """One agent process (elasticrun or torchrun); a thread time-stamps its console output.

    Every line is kept in memory and written to ``log_path`` as ``<seconds since run start> line``,
    so the logs show where the time went. Steps are read with the run's :class:`Client`.
    """

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, started: float, epoch: float,
                 client: Client) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.started = started
        self.client = client
        self.dead = False  # killed on purpose by the benchmark
        self._steps: List[Step] = []
        self.marks: List[Tuple[float, str]] = []  # (time, line) of the agent's "joined" and "round N (...)" lines
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(epoch,), daemon=True)
        self._reader.start()

    def _read(self, epoch: float) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                now = time.time()
                line = raw.decode(errors="replace").rstrip("\n")
                found = self.client.parse(line, now)
                if found:
                    with self._lock:
                        self._steps.extend(found)
                elif MARK_RE.search(line):
                    with self._lock:
                        self.marks.append((now, line))
                log.write(f"{now - epoch:8.3f} {line}\n")
                log.flush()

    def steps(self) -> List[Step]:
        """Every ``(step, world, time)`` that rank 0 printed through this agent so far."""
        with self._lock:
            return list(self._steps)

    def mark(self, text: str) -> Optional[float]:
        """When the first agent line containing ``text`` was read (None if none yet)."""
        with self._lock:
            return next((t for t, line in self.marks if text in line), None)

    def running(self) -> bool:
        """Whether the agent process is still alive."""
        return self.proc.poll() is None

    def join_reader(self) -> None:
        """Wait (briefly) for the output thread once the process and its children are gone."""
        self._reader.join(5)


def tagged_processes(tag_var: str, tag: str) -> List[psutil.Process]:
    """Every live process whose environment carries ``tag_var=tag`` (ours, and only ours)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(tag_var) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def kill_all(procs: List[psutil.Process]) -> None:
    """SIGKILL each process and reap what can be reaped."""
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=5)


def plain_loop(print_every: float = 0.05) -> None:
    """The ``plain`` client: all-reduce forever, report steps from rank 0 (see the module doc)."""
    print(f"BOOT rank {os.environ.get('RANK')} {time.time():.3f}", flush=True)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"PG rank {rank} world {dist.get_world_size()} {time.time():.3f}", flush=True)
    x = torch.ones(1 << 16)
    one = torch.ones(1)
    step, last = 0, 0.0
    while True:
        x.fill_(1.0)
        dist.all_reduce(x)
        w = one.clone()
        dist.all_reduce(w)
        now = time.time()
        if rank == 0 and now - last >= print_every:
            print(f"STEP {step} WORLD {int(w.item())} TIME {now:.3f}", flush=True)
            last = now
        step += 1


def main(argv: Optional[List[str]] = None) -> int:
    """``elastic_clients.py plain``: run the plain client."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["plain"]:
        print("usage: elastic_clients.py plain   (under a launcher)", file=sys.stderr)
        return 2
    plain_loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
