"""``scripts/bench/bench_snapshot.py`` runs, keeps its JSON fields and writes the ``summary`` contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts etcd or processes

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "bench_snapshot.py"


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_stall_and_restore_parts_write_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "snap.json"
    before = set(Path("/dev/shm").glob("elasticrun-bench-snap-*"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mb", "1", "--repeat", "1", "--step-ms", "5",
                           "--overhead-steps", "1", "--json", str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1])["summary"] == doc["summary"]
    for key in ("bytes", "device", "repeat", "snapshot_s", "snapshot_async_stall_s", "disk_save_s",
                "restore_memory_s", "restore_disk_s"):  # the fields of earlier versions
        assert key in doc, key
    assert doc["bytes"] == 1 << 24 and doc["shm_bytes"] >= doc["bytes"]  # one 16 MiB tensor, 2 generations
    for key in ("dcp_save_s", "restore_disk_cold_s", "dcp_load_cold_s", "overhead_snapshot_async_pct"):
        assert isinstance(doc[key], float), key
    rows = doc["summary"]
    assert {r["alternative"] for r in rows} >= {"DCP save", "elasticrun disk load, cold cache", "DCP load, cold cache"}
    for r in rows:
        assert set(r) >= {"metric", "elasticrun", "alternative", "alt_value", "unit", "better", "ratio", "device",
                          "command"}
        assert r["better"] in ("lower", "higher") and r["device"] == "cpu" and r["ratio"] > 0
    assert not set(Path("/dev/shm").glob("elasticrun-bench-snap-*")) - before, "shared memory left behind"


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--parts", "stall,nope"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "nope" in proc.stderr


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_terminated_run_leaves_no_shared_memory(tmp_path: Path) -> None:
    """A time limit's SIGTERM (bench_all) ends the run through its cleanup."""
    from helpers.procs import wait_until

    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--mb", "32", "--repeat", "50"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mine = f"elasticrun-bench-snap-{proc.pid}-"
    try:
        wait_until(lambda: any(p.name.startswith(mine) and (p / "generations").is_dir()
                               for p in Path("/dev/shm").iterdir()), 120, "the bench's first snapshot")
        proc.terminate()
        assert proc.wait(60) == 143
    finally:
        proc.kill()
        proc.wait()
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(mine)]
