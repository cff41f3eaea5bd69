"""The start-up sweep of the memory tier never deletes a live agent's root, never blocks, never reads devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elasticrun.job.shm import LOCK_FILE, OWNER_FILE, PREFIX
from elasticrun.launch.snapshots import SnapshotRoot, sweep

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
    code = f"from elasticrun.launch.snapshots import sweep; print(sweep({str(tmp_path)!r}))"
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
