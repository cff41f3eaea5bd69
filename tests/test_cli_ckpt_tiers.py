"""The memory tier from the user's side: ``elasticrun ckpt list`` shows both tiers, and
``elasticrun run --snapshot-memory SIZE`` / ``--no-snapshots`` reach the workers.

Real files in the real ``/dev/shm`` (a snapshot directory named like an agent's, owned by this
test process), real ``elasticrun`` processes, and real agents with etcd and gloo workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator, Tuple

import pytest
import torch

from elasticrun.checkpoint import Shard, save
from elasticrun.job.shm import root_name
from elasticrun.store.server import EtcdServer

from helpers.ckpt import cli
from helpers.launch import assert_one_line_error, run_cli
from helpers.procs import Agent, wait_until

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "train.py")
SHM = "/dev/shm"

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")]


def _state(v: float) -> dict:
    return {"w": torch.full((8, 4), v), "b": torch.arange(6.0) + v}


@pytest.fixture
def snap_dir() -> Iterator[Tuple[Path, str]]:
    """A snapshot directory as an agent (this test process) makes it, with real generations: two
    complete ones, a torn one, and a replica holding only a peer node's part of a generation."""
    job = f"tiers-{uuid.uuid4().hex[:8]}"
    path = Path(SHM) / root_name(job, "node0", os.getpid())
    path.mkdir(mode=0o700)
    try:
        gens = path / "generations"
        for step in (10, 12):
            save(_state(step), gens, f"snap-{step:08d}-1", training_state={"step": step, "epoch": 0})
        (gens / ".snap-00000014-1.tmp-deadbeef").mkdir()  # a snapshot torn by a crash
        reps = path / "replicas"
        save(_state(12), reps, "snap-00000012-1", training_state={"step": 12, "epoch": 0},
             placements={"w": Shard(0)})
        yield path, job
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_list_shows_memory_and_disk_tiers(snap_dir: Tuple[Path, str], tmp_path: Path) -> None:
    snap_dir, job = snap_dir
    disk = tmp_path / "ckpts"
    save(_state(5), disk, training_state={"step": 5, "epoch": 0})
    res = cli("list", str(disk), "--memory", "--rdzv-id", job, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    got = [(r["tier"], r.get("kind"), r["name"], r["status"], r["step"]) for r in rows]
    assert got == [
        ("disk", None, "step-00000005", "complete", 5),
        ("memory", "generation", "snap-00000010-1", "complete", 10),
        ("memory", "generation", "snap-00000012-1", "complete", 12),
        ("memory", "replica", "snap-00000012-1", "complete", 12),
        ("memory", "generation", "snap-00000014-1", "incomplete", None),
    ], got
    mem = [r for r in rows if r["tier"] == "memory"]
    assert all(r["agent_pid"] == os.getpid() and r["agent_alive"] and r["job"] == job.replace("-", "_")
               for r in mem)
    assert mem[1]["latest"] and mem[1]["root"] == str(snap_dir / "generations")
    assert rows[0]["root"] == str(disk) and rows[0]["latest"]

    # Without ROOT: the memory tier alone, as a table with a tier column.
    res = cli("list", "--rdzv-id", job)
    assert res.returncode == 0, res.stderr
    table = res.stdout
    assert "tier" in table and "memory" in table and "disk" not in table.replace("memory", "")
    assert re.search(r"^snap-00000012-1 ← latest\s+memory \(job ", table, re.M), table  # a pipe: one row a line
    assert "replica" in table and "incomplete" in table

    # Parts of a multi-node generation (other files on other nodes): partial; a damaged file: corrupt.
    rep = snap_dir / "replicas" / "snap-00000012-1"
    shards = sorted(p for p in rep.iterdir() if p.suffix == ".safetensors")
    shards[-1].unlink()
    damaged = sorted(p for p in (snap_dir / "generations" / "snap-00000010-1").iterdir() if p.suffix == ".safetensors")
    damaged[0].write_bytes(damaged[0].read_bytes()[:-1])
    rows = {(r["kind"], r["name"]): r for r in json.loads(cli("list", "--rdzv-id", job, "--json").stdout)}
    row = rows[("replica", "snap-00000012-1")]
    assert row["status"] == "partial" and (row["files_here"], row["files_total"]) == (len(shards) - 1, len(shards))
    assert rows[("generation", "snap-00000010-1")]["status"] == "corrupt"

    # Another job's filter sees nothing; no ROOT with --no-memory is one clear line.
    res = cli("list", "--rdzv-id", "no-such-job-" + job)
    assert res.returncode == 0 and "no memory snapshots on this machine for job" in res.stdout
    assert json.loads(cli("list", "--memory", "--rdzv-id", "no-such-job", "--json").stdout) == []
    res = cli("list", "--no-memory")
    assert res.returncode == 2 and "give a checkpoint ROOT, or --memory" in res.stderr
    assert "Traceback" not in res.stderr
    # ROOT alone: the disk tier as before (plus its tier field).
    assert [(r["tier"], r["name"]) for r in json.loads(cli("list", str(disk), "--json").stdout)] == [
        ("disk", "step-00000005")]


@pytest.mark.parametrize("flag,value", [("--snapshot-memory", "lots"), ("--snapshot-memory", "0"),
                                        ("--snapshot-memory", "-1G")])
def test_bad_snapshot_memory_is_one_line(flag: str, value: str) -> None:
    proc = run_cli(["--standalone", flag, value, EXAMPLE], timeout=60)
    assert_one_line_error(proc, "--snapshot-memory")
    assert proc.returncode == 2


def test_bad_snapshot_memory_variable_is_one_line() -> None:
    proc = run_cli(["--standalone", EXAMPLE], timeout=60, env={"ELASTICRUN_SNAPSHOT_MEMORY": "8 apples"})
    assert_one_line_error(proc, "ELASTICRUN_SNAPSHOT_MEMORY='8 apples'", "not a size")
    assert proc.returncode == 2


def _rank0(agent: Agent) -> str:
    return "\n".join(m.group(1) for m in re.finditer(r"^\[[^\]/]+/0\]:(.*)$", agent.stdout(), re.M))


def test_live_job_memory_tier_listed_and_cap_reaches_workers(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, job_id: str
) -> None:
    common = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint, "--no-prewarm",
              "--shutdown-timeout", "3"]
    train = [EXAMPLE, "--epochs", "1000", "--dataset-size", "256", "--snapshot-every", "2", "--ckpt-every", "0"]
    live = agents([*common, "--rdzv-id", job_id, "--snapshot-memory", "64MiB", *train, "--step-sleep", "0.05",
                   "--steps", "100000", "--ckpt-dir", str(tmp_path / "a")], name="live")
    small = agents([*common, "--rdzv-id", job_id + "-small", "--snapshot-memory", "1KiB", *train, "--steps", "6",
                    "--ckpt-dir", str(tmp_path / "b")], name="small")
    off = agents([*common, "--rdzv-id", job_id + "-off", "--no-snapshots", *train, "--steps", "6",
                  "--ckpt-dir", str(tmp_path / "c")], name="off")

    def memory_rows() -> list:
        res = cli("list", "--rdzv-id", job_id, "--json")
        assert res.returncode == 0, res.stderr
        return [r for r in json.loads(res.stdout) if r["status"] == "complete" and r["step"] and r["step"] >= 4]

    def live_step() -> int:
        found = re.findall(r"^step (\d+) ", _rank0(live), re.M)
        return int(found[-1]) if found else 0

    # its output first (cheap), then the CLI (a process per poll, competing with the three jobs for CPU)
    wait_until(lambda: live_step() >= 6, 180, "the live job at step 6\n" + live.output()[-3000:])
    wait_until(lambda: memory_rows(), 180, "the live job's memory generations\n" + live.output()[-3000:])
    rows = memory_rows()
    assert all(r["tier"] == "memory" and r["agent_pid"] == live.pid and r["agent_alive"] for r in rows), rows
    assert len({r["name"] for r in rows if r["kind"] == "generation"}) <= 2  # keep=2 generations

    assert small.wait(180) == 0, small.output()[-3000:]
    assert re.search(r"memory snapshots disabled: .*caps them at 1\.0 KiB", _rank0(small)), _rank0(small)
    assert off.wait(180) == 0, off.output()[-3000:]
    assert re.search(r"memory snapshots disabled: no memory tier", _rank0(off)), _rank0(off)
    assert not [d for d in os.listdir(SHM) if d.startswith("elasticrun-snap-") and f"-{off.pid}" in d[-12:]]
    assert "done: steps=6 " in _rank0(small) and "done: steps=6 " in _rank0(off)
