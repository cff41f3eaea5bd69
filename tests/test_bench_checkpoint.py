"""``scripts/bench/bench_checkpoint.py`` answers a bad ``--dir`` with one line (no traceback, no run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts a process

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "bench_checkpoint.py"


@pytest.mark.parametrize("where", ["missing", "a-file"])
def test_a_dir_that_is_no_directory_is_one_line(tmp_path: Path, where: str) -> None:
    target = tmp_path / where
    if where == "a-file":
        target.write_text("not a directory")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(target), "--size-gib", "0.001"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--dir" in proc.stderr and str(target) in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([where] if where == "a-file" else []), "nothing written"
