"""The commit fence holds up to the commit itself: a real etcd, a real writer process frozen
(SIGSTOP) inside its commit while the job moves to the next round, and that round's resume.

- frozen after its shards and metadata are written (where the round used to be checked already):
  the check right before the rename refuses it;
- frozen after that check, right before the rename: the next round's resume fences its temporary
  directory, and the late rename publishes nothing.

Either way the stale checkpoint is never committed and never "latest".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import torch

from elasticrun.checkpoint import list_checkpoints, load, save
from elasticrun.checkpoint.storage import get_storage
from elasticrun.checkpoint.temps import fence_older_saves
from elasticrun.job.keys import JobKeys
from elasticrun.store.client import EtcdStore
from elasticrun.train import load_latest

pytestmark = pytest.mark.integration  # starts etcd or processes

REPO = Path(__file__).resolve().parent.parent

# Saves step 5 with the commit frozen (SIGSTOP to itself) at STALL: "metadata" (its write) or "rename".
WRITER = r"""
import os, signal, sys
import torch
import elasticrun.train  # installs the commit fence (its etcd read)
from elasticrun.checkpoint import save
from elasticrun.checkpoint.storage import LocalStorage
from elasticrun.errors import CheckpointError

root, stall = sys.argv[1], sys.argv[2]
write_bytes, rename_dir = LocalStorage.write_bytes, LocalStorage.rename_dir

def freeze():
    os.kill(os.getpid(), signal.SIGSTOP)

def frozen_write(self, path, data):
    if stall == "metadata" and path.endswith("/metadata.json"):
        freeze()
    return write_bytes(self, path, data)

def frozen_rename(self, src, dst):
    if stall == "rename":
        freeze()
    return rename_dir(self, src, dst)

LocalStorage.write_bytes, LocalStorage.rename_dir = frozen_write, frozen_rename
try:
    save({"w": torch.full((8,), 5.0)}, root, training_state={"step": 5})
    print("COMMITTED", flush=True)
except CheckpointError as err:
    print("REFUSED", err, flush=True)
"""


@pytest.fixture
def round_env(etcd: EtcdStore, job_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """This process as a worker of ``job_id`` in round 1 (the job's topology says round 1)."""
    etcd.put_json(JobKeys(job_id).topology, {"round": 1})
    env = {"ELASTICRUN_RDZV_ENDPOINT": etcd.endpoints, "ELASTICRUN_RDZV_ID": job_id, "ELASTICRUN_ROUND": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env


def _frozen_writer(root: Path, stall: str, env: dict) -> subprocess.Popen:
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), stall], env=full, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the writer never froze at {stall}: {proc.communicate()[0][-3000:]}")


def _thaw(proc: subprocess.Popen) -> str:
    """SIGCONT the frozen writer; its output once it is done."""
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    return out


@pytest.mark.parametrize("stall,resume", [("metadata", False), ("metadata", True), ("rename", True)])
def test_a_writer_frozen_in_its_commit_never_publishes_a_stale_round(
        stall: str, resume: bool, tmp_path: Path, etcd: EtcdStore, job_id: str, round_env: dict,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen before its commit check (``metadata``): the check refuses it, also when round 2 has not
    touched the root; frozen after it (``rename``): round 2's resume fenced its directory."""
    root = tmp_path / "ckpts"
    save({"w": torch.full((8,), 4.0)}, str(root), training_state={"step": 4})  # round 1's last good one
    writer = _frozen_writer(root, stall, round_env)
    try:
        # The job moves on without the frozen node: round 2 forms (and resumes from the root).
        etcd.put_json(JobKeys(job_id).topology, {"round": 2})
        monkeypatch.setenv("ELASTICRUN_ROUND", "2")
        if resume:
            resumed = load_latest(str(root))
            assert resumed is not None and resumed.training_state.step == 4
    finally:
        out = _thaw(writer)
    assert "REFUSED" in out and "a stale round must not commit" in out, out
    complete = [i.name for i in list_checkpoints(str(root)) if i.status == "complete"]
    assert complete == ["step-00000004"], complete
    assert load(str(root)).name == "step-00000004", "the stale checkpoint is never latest"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [], "nothing of the stale save is left"
    # Round 2 saves step 5 itself: the name was never taken by the stale round.
    assert save({"w": torch.full((8,), 50.0)}, str(root), training_state={"step": 5}) == "step-00000005"


def test_only_older_rounds_of_the_same_job_are_fenced(tmp_path: Path, round_env: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()

    def temp(name: str, marker: dict) -> Path:
        d = root / f".{name}.tmp-abc"
        d.mkdir()
        (d / ".elasticrun-incomplete").write_text(json.dumps(marker))
        return d

    job = round_env["ELASTICRUN_RDZV_ID"]
    older = temp("a", {"job": job, "round": 0})
    same = temp("b", {"job": job, "round": 1})
    newer = temp("c", {"job": job, "round": 2})
    other = temp("d", {"job": "another-job", "round": 0})
    plain = temp("e", {"host": "h", "pid": 1})  # a save outside elasticrun
    assert fence_older_saves(get_storage(str(root))) == [older.name]
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in (same, newer, other, plain))
    monkeypatch.delenv("ELASTICRUN_ROUND")  # outside a round: nothing is fenced
    assert fence_older_saves(get_storage(str(root))) == []
