"""The training scripts ``bench_elastic.py`` measures (``--client``).

``bench``, ``inplace``, ``plain``: the loops of ``elastic_worker.py``; ``example``: ``examples/train.py`` (DDP,
elastic sampler, checkpoint on SIGTERM, control polling). A step line yields ``(step, world size, unix time)``;
a client that prints no time gets the time the benchmark read the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from common import TRAIN

HERE = Path(__file__).resolve().parent
STEP_RE = re.compile(r"STEP (\d+) WORLD (\d+) TIME (\d+(?:\.\d+)?)")
EXAMPLE_RE = re.compile(r"(?:^|\]:)step (\d+) loss \S+ world (\d+)")
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

    def parse(self, line: str, read_at: float) -> Optional[List[Step]]:
        """The steps that one output line reports (None: none)."""
        if self.name == "example":
            m = EXAMPLE_RE.search(line)
            return [(int(m[1]), int(m[2]), read_at)] if m else None
        return [(int(m[1]), int(m[2]), float(m[3])) for m in STEP_RE.finditer(line)] or None


CLIENTS = {name: Client(name) for name in ("bench", "plain", "example", "inplace")}
