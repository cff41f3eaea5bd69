"""``scripts/bench/bench_rendezvous.py`` drives the agent's own rendezvous code: at 4 simulated agents it
completes round 0, a loss and a join, with every row's counts (so a change of the agent's rendezvous API
breaks the bench here, not silently in a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_rendezvous.py"


def test_the_bench_completes_its_three_phases(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--clients", "shared", "--nodes", "4", "--heartbeat", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["phase"], r["round"], r["agents"]) for r in rows] == [("round 0", 0, 4), ("loss", 1, 3), ("join", 2, 4)]
    assert not [r for r in rows if "failed" in r], rows
    assert all(r["loop_turns"] > 0 and r["etcd_writes"] > 0 and "formed_s" in r for r in rows), rows
    loss = rows[1]
    assert 0 <= loss["reform_s"] <= loss["all_hold_s"], "the leader saw the loss before every survivor held the round"
    assert "FAILED" not in proc.stdout
