"""The training scripts ``bench_elastic.py`` measures (``--client``) and the agent processes that run them.

``bench``, ``inplace``, ``plain``: the loops of ``elastic_worker.py``; ``example``: ``examples/train.py`` (DDP,
elastic sampler, checkpoint on SIGTERM, control polling). A step line yields ``(step, world size, unix time)``;
a client that prints no time gets the time the benchmark read the line.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from common import TRAIN

HERE = Path(__file__).resolve().parent
STEP_RE = re.compile(r"STEP (\d+) WORLD (\d+) TIME (\d+(?:\.\d+)?)")
EXAMPLE_RE = re.compile(r"(?:^|\]:)step (\d+) loss \S+ world (\d+)")
MARK_RE = re.compile(r"elasticrun\[[^]]*\]: (joined job|round \d+ \(\w+\): world size|the job's etcd is at )")
Step = Tuple[int, int, float]


@dataclass(frozen=True)
class Client:
    """One training script under test."""

    name: str

    def argv(self, out_dir: Path) -> List[str]:
        """The script and its arguments (after the launcher's own options)."""
        if self.name == "example":
            return [str(TRAIN), "--epochs", "1000000", "--ckpt-dir",
                    str(out_dir / "ckpt"), "--ckpt-every", "0", "--step-sleep", "0.05"]
        return [str(HERE / "elastic_worker.py"), self.name, str(out_dir)]

    def parse(self, line: str, read_at: float) -> List[Step]:
        """The steps that one output line reports."""
        if self.name == "example":
            m = EXAMPLE_RE.search(line)
            return [(int(m[1]), int(m[2]), read_at)] if m else []
        return [(int(m[1]), int(m[2]), float(m[3])) for m in STEP_RE.finditer(line)]


CLIENTS = {name: Client(name) for name in ("bench", "plain", "example", "inplace")}


class Node:
    """One agent process (elasticrun or torchrun); a thread time-stamps its console output into ``log_path``
    (``<seconds since the run's start> line``) and keeps the steps and the agent's phase lines it reports."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, started: float, epoch: float,
                 client: Client) -> None:
        self.name, self.proc, self.log_path, self.started, self.client = name, proc, log_path, started, client
        self.dead = False  # killed or stopped on purpose by the benchmark
        self._steps: List[Step] = []
        self.marks: List[Tuple[float, str]] = []  # (time, line): the agent's "joined", "round N (...)", etcd lines
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
                with self._lock:
                    if found:
                        self._steps.extend(found)
                    elif MARK_RE.search(line):
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
        return self.proc.poll() is None

    def join_reader(self) -> None:
        """Wait (briefly) for the output thread once the process and its children are gone."""
        self._reader.join(5)
