"""A member's directory (launch/etcdhome.py): removed by its agent, or swept once its agent is gone."""

from __future__ import annotations

import os
from pathlib import Path

from elasticrun.launch.etcdhome import MemberHome, sweep


def test_a_home_is_private_and_removed_by_its_agent(tmp_path: Path) -> None:
    home = MemberHome.create("job", "node@a:1", base=str(tmp_path))
    assert os.stat(home.path).st_mode & 0o777 == 0o700
    assert os.path.basename(home.path).startswith(f"etcd-job-node_a_1-{os.getpid()}-")
    assert home.data_dir.startswith(home.path) and home.log_path.startswith(home.path)
    home.remove()
    assert not os.path.exists(home.path)


def test_the_sweep_removes_the_homes_of_gone_agents_only(tmp_path: Path) -> None:
    live = MemberHome.create("job", "a", base=str(tmp_path))
    dead = MemberHome.create("job", "b", base=str(tmp_path))
    os.makedirs(dead.data_dir)
    assert dead.lock_fd is not None
    os.close(dead.lock_fd)  # its agent died: the kernel dropped the lock
    dead.lock_fd = None
    other = tmp_path / "etcd-not-a-home"  # a name the sweep does not own
    other.mkdir()
    assert sweep(str(tmp_path)) == [dead.path]
    assert os.path.isdir(live.path) and other.is_dir()
    MemberHome.create("job", "c", base=str(tmp_path)).remove()  # creating one sweeps too
    live.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etcd-not-a-home"]
