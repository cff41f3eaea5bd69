"""``elasticrun check`` on a GPU node: NVML rows per GPU, a matmul per GPU, the all-reduce (skips without GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticrun.health.nvml import read_gpus

from helpers.procs import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(400)]


def test_check_reads_nvml_and_measures_every_gpu(tmp_path: Path) -> None:
    gpus = read_gpus()
    if not gpus:
        pytest.skip("no NVIDIA GPU here")
    done = subprocess.run([sys.executable, "-m", "elasticrun", "check", "--json", "--ckpt-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))
    doc = json.loads(done.stdout)
    rows = {c["check"]: c for c in doc["checks"]}
    for g in gpus:
        for name in ("temperature", "clock throttling", "memory free", "matmul bf16"):
            row = rows[f"gpu{g.index} {name}"]
            assert row["figure"] is not None, row
    assert any(name.startswith("all-reduce") for name in rows)
    # a healthy test machine passes; what failed is printed for the operator otherwise
    assert done.returncode == (0 if doc["passed"] else 6), done.stderr
    print(json.dumps(doc, indent=1))
