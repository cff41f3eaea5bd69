"""The hosted etcd's lock on ip:port: private to its user, removed at release, never held by the dead.

Real files and real processes (a holder is a child process with its own flock)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elasticrun.launch.hostlock import HostLock, private_dir

from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
time.sleep(600)
"""


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The machine's shared temp dir, as every user sees it (no XDG runtime dir)."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


def hold(path: Path, tmp_path: Path) -> subprocess.Popen:
    """A process that holds ``path``'s flock until killed."""
    ready = tmp_path / f"held-{path.name}"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(ready)])
    wait_until(ready.exists, 20, "the holder to lock")
    return proc


def test_lock_is_private_and_removed_at_release(shared_tmp: Path):
    lock = HostLock("127.0.0.1", 23790)
    assert lock.acquire()
    assert lock.path is not None
    folder = os.path.dirname(lock.path)
    assert Path(folder).parent == shared_tmp
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(lock.path).st_mode) == 0o600
    second = HostLock("127.0.0.1", 23790)
    assert not second.acquire(), "a second agent of ours must join, not host"
    lock.release()
    assert not os.path.exists(lock.path), "the lock file is removed at release"
    assert second.acquire()
    second.release()


def test_a_predictable_shared_file_held_by_another_user_cannot_block_hosting(shared_tmp: Path, tmp_path: Path):
    """Old code locked <tmp>/elasticrun-etcd-IP-PORT.lock (mode 0666): anyone holding it made every agent
    believe another one hosted, and the job never started."""
    squatter = hold(shared_tmp / "elasticrun-etcd-127.0.0.1-23791.lock", tmp_path)
    try:
        lock = HostLock("127.0.0.1", 23791)
        assert lock.acquire()
        lock.release()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_lock_of_a_dead_process_never_blocks(shared_tmp: Path, tmp_path: Path):
    lock = HostLock("127.0.0.1", 23792)
    assert lock.path is not None
    holder = hold(Path(lock.path), tmp_path)
    try:
        assert not lock.acquire(), "a live holder keeps it"
    finally:
        holder.kill()  # SIGKILL: its file stays, its lock goes
        holder.wait()
    assert os.path.exists(lock.path)
    assert lock.acquire()
    lock.release()


def test_a_directory_not_ours_or_open_to_others_is_never_used(shared_tmp: Path):
    planted = shared_tmp / f"elasticrun-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)  # e.g. made by someone else for us to use
    assert private_dir() is None
    lock = HostLock("127.0.0.1", 23793)
    assert lock.path is None and lock.acquire(), "no private dir: the port check alone decides (never blocks)"
    planted.rmdir()
    os.symlink(str(shared_tmp), str(planted))  # a link to somewhere else
    assert private_dir() is None
