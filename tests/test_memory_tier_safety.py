"""The start-up sweep of the memory tier never deletes a live agent's root, never blocks, never reads devices."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticrun.job.shm import LOCK_FILE, OWNER_FILE, PREFIX
from elasticrun.launch.shmroot import SnapshotRoot, sweep

pytestmark = pytest.mark.integration  # starts etcd or processes

_HOLD = (
    "import fcntl, sys\n"
    "f = open(sys.argv[1], 'rb'); fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True); sys.stdin.read()\n"
)


def test_sweep_keeps_a_live_agent_whose_pid_means_nothing_here(tmp_path: Path):
    # An agent in another pid namespace: the pid in its name is dead here, but it holds its lock.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / f"{PREFIX}j-abcdef01-{dead.pid}"
    root.mkdir()
    (root / LOCK_FILE).write_text("")
    (root / OWNER_FILE).write_text(f"{dead.pid} 1\n")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(root / LOCK_FILE)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert sweep(str(tmp_path)) == []
        assert root.exists()
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
    assert sweep(str(tmp_path)) == [str(root)]  # its agent is gone: now it goes


def test_sweep_never_blocks_on_fifos_nor_follows_links(tmp_path: Path):
    fifo_root = tmp_path / f"{PREFIX}j-abcdef01-1"
    fifo_root.mkdir()
    os.mkfifo(fifo_root / OWNER_FILE)
    os.mkfifo(fifo_root / LOCK_FILE)
    link_root = tmp_path / f"{PREFIX}j-abcdef01-2"
    link_root.mkdir()
    os.symlink("/dev/zero", link_root / OWNER_FILE)
    os.symlink("/dev/zero", link_root / LOCK_FILE)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("keep")
    (victim / LOCK_FILE).write_text("")
    os.symlink(victim, tmp_path / f"{PREFIX}j-abcdef01-3")
    code = f"from elasticrun.launch.shmroot import sweep; print(sweep({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert (victim / "data").read_text() == "keep"


def test_an_agent_holds_its_root_lock_until_it_removes_it(tmp_path: Path):
    root = SnapshotRoot.create("j", "node", base=str(tmp_path))
    assert root is not None
    try:
        assert sweep(str(tmp_path)) == []
        assert os.path.isdir(root.path)
    finally:
        root.remove()
    assert not os.path.exists(root.path)


_CREATE_PAUSED = (
    "import fcntl, os, sys, time\n"
    "import elasticrun.launch.shmroot as snaps\n"
    "base, paused, go = sys.argv[1:4]\n"
    "real = fcntl.flock\n"
    "def slow_flock(fd, op):\n"
    "    if not os.path.exists(paused):  # the first flock: stand still here until the sweep ran\n"
    "        open(paused, 'w').close()\n"
    "        deadline = time.monotonic() + 60\n"
    "        while not os.path.exists(go) and time.monotonic() < deadline:\n"
    "            time.sleep(0.01)\n"
    "    return real(fd, op)\n"
    "snaps.fcntl.flock = slow_flock\n"
    "root = snaps.SnapshotRoot.create('j', 'node', base=base)\n"
    "print(root.path if root else 'none', flush=True)\n"
    "sys.stdin.read()\n"
    "root.remove()\n"
)


def test_a_sweep_while_an_agent_creates_its_root_never_removes_it(tmp_path: Path):
    """Another agent's start-up sweep runs while this one creates its root and has not yet locked
    its lock file: the new root must survive, locked (else that node silently has no memory tier)."""
    shm, paused, go = tmp_path / "shm", tmp_path / "paused", tmp_path / "go"
    shm.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    creator = subprocess.Popen([sys.executable, "-c", _CREATE_PAUSED, str(shm), str(paused), str(go)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not paused.exists() and creator.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert paused.exists(), "the creating agent never reached its flock"
        code = f"from elasticrun.launch.shmroot import sweep; print(sweep({str(shm)!r}))"
        swept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert swept.returncode == 0, swept.stderr
        assert swept.stdout.strip() == "[]", "the sweep removed a root that was being created"
        go.touch()
        path = creator.stdout.readline().strip()
        assert path != "none" and os.path.isdir(path), path
        assert sweep(str(shm)) == [] and os.path.isdir(path), "the live root's lock is held"
        assert sorted(os.listdir(path)) == [LOCK_FILE, OWNER_FILE], "no private lock name left behind"
    finally:
        creator.stdin.close()
        creator.wait(30)
        creator.stdout.close()
    assert sweep(str(shm)) == [] and os.listdir(shm) == [], "the agent removed its root when it ended"
