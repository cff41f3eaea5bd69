"""Memory snapshots in one process: generations, retention, the cap, torn generations, tiers on
resume, persistence to disk, and the agent-side directory (creation, watchdog, sweep)."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticrun.checkpoint import Checksum, SnapshotMemoryError, Snapshotter, list_checkpoints, save, verify
from elasticrun.job.shm import GENERATIONS, LOCK_FILE, OWNER_FILE, PREFIX
from elasticrun.launch.shmroot import SnapshotRoot, sweep
from elasticrun.train import load_latest

from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A snapshot directory named by ELASTICRUN_SNAPSHOT_DIR, as the agent would set it."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(d))
    monkeypatch.delenv("ELASTICRUN_SNAPSHOT_MEMORY", raising=False)
    return d


def _state(value: float) -> dict:
    return {"w": torch.full((64, 32), value), "b": torch.full((7,), value), "note": "x"}


def _gens(base: Path) -> list:
    return [i for i in list_checkpoints(str(base / GENERATIONS)) if i.status == "complete"]


def test_snapshots_keep_two_generations_and_resume_prefers_the_newest_tier(base: Path, tmp_path: Path):
    disk = str(tmp_path / "disk")
    save(_state(3.0), disk, training_state={"step": 3})
    snaps = Snapshotter()
    for step in range(1, 7):
        snaps.snapshot(_state(float(step)), training_state={"step": step})
    assert [i.meta.step for i in _gens(base)] == [5, 6], "retention keeps the last two generations"
    assert snaps.generation_bytes == (64 * 32 + 7) * 4
    ckpt = load_latest(disk)
    assert (ckpt.tier, ckpt.training_state.step, float(ckpt.state_dict["w"][0, 0])) == ("memory", 6, 6.0)
    assert ckpt.state_dict["note"] == "x"
    disk_only = load_latest(disk, memory=False)
    assert (disk_only.tier, disk_only.training_state.step) == ("disk", 3)
    # A disk checkpoint newer than every generation wins.
    save(_state(9.0), disk, training_state={"step": 9})
    assert (load_latest(disk).tier, load_latest(disk).training_state.step) == ("disk", 9)


def test_resume_from_an_older_checkpoint_drops_newer_generations(base: Path, tmp_path: Path, monkeypatch):
    disk = str(tmp_path / "disk")
    snaps = Snapshotter()
    snaps.snapshot(_state(4.0), training_state={"step": 4})
    save(_state(2.0), disk, training_state={"step": 2})
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(tmp_path / "elsewhere"))  # e.g. rank 0 on another node
    assert load_latest(disk).training_state.step == 2
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    assert [i.meta.step for i in _gens(base)] == [4]
    # The job went on from step 2 without this node's memory tier: its step-4 generation is from
    # an abandoned timeline; loading anything older than it removes it.
    load_latest(disk, memory=False)
    assert _gens(base) == []


def test_a_torn_generation_is_never_loaded(base: Path, tmp_path: Path):
    """A process SIGKILLed after writing its shard, before the commit: the older generation loads."""
    disk = str(tmp_path / "disk")
    Snapshotter().snapshot(_state(1.0), training_state={"step": 1})
    code = ("import torch; from elasticrun.checkpoint import snapshot\n"
            "snapshot({'w': torch.full((64, 32), 2.0), 'b': torch.zeros(7), 'note': 'x'}, training_state={'step': 2})")
    env = dict(os.environ, ELASTICRUN_CKPT_CRASH_AT="after-shards", ELASTICRUN_SNAPSHOT_DIR=str(base))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    entries = list_checkpoints(str(base / GENERATIONS))
    assert any(i.temporary for i in entries), [(i.name, i.status) for i in entries]
    # A generation directory without its commit marker (metadata.json) is not one either.
    fake = base / GENERATIONS / "snap-00000099-1"
    fake.mkdir()
    (fake / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * 64)
    ckpt = load_latest(disk)
    assert (ckpt.tier, ckpt.training_state.step, float(ckpt.state_dict["w"][0, 0])) == ("memory", 1, 1.0)
    # The next worker's first snapshot frees the torn generation's shared memory.
    Snapshotter().snapshot(_state(3.0), training_state={"step": 3})
    assert not any(i.temporary for i in list_checkpoints(str(base / GENERATIONS)))
    assert load_latest(disk).training_state.step == 3


def test_memory_cap_is_one_clear_error(base: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_MEMORY", "10KiB")
    with pytest.raises(SnapshotMemoryError) as err:
        Snapshotter().snapshot(_state(1.0), training_state={"step": 1})
    msg = str(err.value)
    assert "\n" not in msg
    assert "need 24.1 KiB (3 generations of 8.0 KiB)" in msg and "caps them at 10.0 KiB" in msg, msg
    assert _gens(base) == []
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_MEMORY", "10KB")  # the one size rule: KB = 1000 bytes
    with pytest.raises(SnapshotMemoryError, match=r"caps them at 9\.8 KiB"):
        Snapshotter().snapshot(_state(1.0), training_state={"step": 1})
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_MEMORY", "lots")
    with pytest.raises(SnapshotMemoryError, match="ELASTICRUN_SNAPSHOT_MEMORY: not a size: 'lots'"):
        Snapshotter().snapshot(_state(1.0), training_state={"step": 1})


def test_without_a_memory_tier_snapshot_says_so(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ELASTICRUN_SNAPSHOT_DIR", raising=False)
    with pytest.raises(Exception, match="no memory tier: ELASTICRUN_SNAPSHOT_DIR is not set"):
        Snapshotter().snapshot(_state(1.0))


@pytest.mark.parametrize("async_snapshots", [False, True])
def test_every_kth_generation_is_persisted_to_disk(base: Path, tmp_path: Path, async_snapshots: bool):
    disk = str(tmp_path / "disk")
    snaps = Snapshotter(persist_to=disk, persist_every=2, async_snapshots=async_snapshots)
    for step in range(1, 5):
        snaps.snapshot(_state(float(step)), training_state={"step": step})
        snaps.wait()  # each copy finishes before the next is due: steps 2 and 4 are persisted
    snaps.close()
    on_disk = [i for i in list_checkpoints(disk) if i.status == "complete"]
    assert [i.meta.step for i in on_disk] == [2, 4]
    assert all(verify(disk, i.name).ok for i in on_disk)
    # Memory carries the memory tier's checksum; the disk copies only the public format's CRC-32.
    assert {e.algo for g in _gens(base) for e in g.meta.files.values()} == {Checksum.WORDSUM}
    assert {e.algo for i in on_disk for e in i.meta.files.values()} == {Checksum.CRC32}
    assert not os.listdir(base / "persist"), "the hard-linked staging copies are removed"
    ckpt = load_latest(disk, memory=False)
    assert float(ckpt.state_dict["w"][0, 0]) == 4.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_sync_snapshot_of_cuda_state_is_copied_through_pinned_buffers(base: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """As a disk save: the device-to-host copies go through the pinned staging buffers (overlapped
    with the writes), not one pageable ``.cpu()`` per tensor; the restore lands in CUDA tensors."""
    from elasticrun.checkpoint import staging

    taken = []
    take = staging._take_buffers
    monkeypatch.setattr(staging, "_take_buffers", lambda n, pinned, *a: taken.append(pinned) or take(n, pinned, *a))
    state = {"w": torch.randn(3000, 700, device="cuda"), "b": torch.arange(7.0, device="cuda"), "note": "x"}
    state["w"].mul_(2)  # queued on the current stream: the snapshot must see it
    Snapshotter().snapshot(state, training_state={"step": 1})
    assert taken and all(taken), "the snapshot did not stage through pinned buffers"
    target = {"w": torch.zeros(3000, 700, device="cuda"), "b": torch.zeros(7, device="cuda"), "note": ""}
    ckpt = load_latest(str(tmp_path / "disk"), state_dict=target)
    assert ckpt.tier == "memory" and target["w"].is_cuda
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


# -- the agent's directory ------------------------------------------------------------------------


def test_snapshot_root_is_private_and_removed_by_its_owner(tmp_path: Path):
    root = SnapshotRoot.create("job/1", "node-a", base=str(tmp_path))
    assert root is not None and os.path.basename(root.path).startswith(PREFIX + "job_1-")
    assert stat.S_IMODE(os.stat(root.path).st_mode) == 0o700
    assert (Path(root.path) / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    (Path(root.path) / "generations").mkdir()
    watchdog = root.watchdog
    root.remove()
    assert not os.path.exists(root.path) and watchdog is not None and watchdog.returncode == 0


def test_watchdog_removes_the_directory_when_its_owner_dies(tmp_path: Path):
    """A child process owns the root and is SIGKILLed: its watchdog (another session) removes it."""
    code = ("import sys, time; from elasticrun.launch.shmroot import SnapshotRoot\n"
            "r = SnapshotRoot.create('j', 'n', base=sys.argv[1]); print(r.path, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        path = owner.stdout.readline().strip()
        assert os.path.isdir(path)
        Path(path, "data").write_bytes(b"x" * 4096)
        owner.kill()
        owner.wait(30)
        wait_until(lambda: not os.path.exists(path), 30, "the watchdog to remove the snapshot root")
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.stdout.close()


def test_sweep_removes_only_roots_of_dead_agents(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}j-abcdef01-{dead.pid}"
    stale.mkdir()
    (stale / LOCK_FILE).write_text("")  # nobody holds its lock
    alive = tmp_path / f"{PREFIX}j-abcdef01-{os.getpid()}"
    alive.mkdir()
    (alive / LOCK_FILE).write_text("")
    held = open(alive / LOCK_FILE, "rb")
    fcntl.flock(held, fcntl.LOCK_EX)
    reused = tmp_path / f"{PREFIX}k-abcdef01-{os.getpid()}"  # our pid, but its lock is free
    reused.mkdir()
    (reused / LOCK_FILE).write_text("")
    other = tmp_path / "not-ours-123"
    other.mkdir()
    unnamed = tmp_path / f"{PREFIX}j-abc-{dead.pid}"  # not a root's name (job/shm.py's rule): never ours
    unnamed.mkdir()
    (unnamed / LOCK_FILE).write_text("")
    assert sorted(sweep(str(tmp_path))) == sorted([str(stale), str(reused)])
    held.close()
    assert alive.exists() and other.exists() and unnamed.exists()
