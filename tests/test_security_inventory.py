"""docs/security.md's inventory, checked on a real agent: the files it creates in shared places
(mode, owner, private directories) and the addresses it listens on."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

import psutil
import pytest

from elasticrun.store.server import free_port

from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

PROBE = """\
import json, os, stat, sys, time

def info(path):
    st = os.lstat(path)
    return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "dir": stat.S_ISDIR(st.st_mode)}

out, stop = sys.argv[1], sys.argv[2]
settings = os.environ["ELASTICRUN_ETCD_SETTINGS_FILE"]
snap = os.environ["ELASTICRUN_SNAPSHOT_DIR"]
report = {"settings": info(settings), "run_dir": info(os.path.dirname(settings)),
          "run_dir_path": os.path.dirname(settings), "snap": info(snap), "snap_path": snap,
          "snap_lock": info(os.path.join(snap, "lock")), "uid": os.geteuid(),
          "error_file": os.environ["TORCHELASTIC_ERROR_FILE"]}
with open(out + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(out + ".tmp", out)
deadline = time.monotonic() + 300
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def _listening(pids: List[int]) -> Set[Tuple[str, int]]:
    found: Set[Tuple[str, int]] = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def test_an_agents_files_and_ports_are_what_docs_security_md_says(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    script, out, stop, events = tmp_path / "probe.py", tmp_path / "probe.json", tmp_path / "stop", tmp_path / "ev"
    script.write_text(PROBE)
    old = os.umask(0o000)  # the modes below do not rely on the user's umask
    try:
        agent = agents(["--standalone", "--nproc-per-node", "1", "--metrics-port", "0", "--events-file", str(events),
                        str(script), str(out), str(stop)])
    finally:
        os.umask(old)
    try:
        wait_until(out.exists, 120, "the probe worker's report")
        seen: Dict = json.loads(out.read_text())
        me = seen["uid"]
        assert seen["run_dir"] == {"mode": 0o700, "uid": me, "dir": True}
        assert seen["settings"] == {"mode": 0o600, "uid": me, "dir": False}
        assert seen["error_file"].startswith(seen["run_dir_path"] + os.sep)
        assert seen["snap"] == {"mode": 0o700, "uid": me, "dir": True}
        assert seen["snap_path"].startswith("/dev/shm/elasticrun-snap-")
        assert seen["snap_lock"] == {"mode": 0o600, "uid": me, "dir": False}
        assert stat.S_IMODE(events.stat().st_mode) == 0o600
        # the private etcd of --standalone listens on loopback only; the round's c10d store (torch's
        # TCPStore, on a socket the agent binds and its store host serves) on every interface, as the
        # table says
        family = [agent.pid, *(p.pid for p in agent.descendants())]
        etcd = [p.pid for p in agent.descendants() if "etcd" in p.name()]
        assert etcd and {ip for ip, _ in _listening(etcd)} == {"127.0.0.1"}, _listening(etcd)
        others = [pid for pid in family if pid not in etcd]
        assert {"0.0.0.0", "::"} & {ip for ip, _ in _listening(others)}, _listening(family)
    finally:
        stop.touch()
    assert agent.wait(60) == 0, agent.output()
    assert not os.path.exists(seen["run_dir_path"]) and not os.path.exists(seen["snap_path"]), "removed at exit"


def test_metrics_listen_on_loopback_unless_told(tmp_path: Path, agents: Callable[..., Agent]) -> None:
    script, out, stop = tmp_path / "probe.py", tmp_path / "probe.json", tmp_path / "stop"
    script.write_text(PROBE)
    port = free_port()
    agent = agents(["--standalone", "--nproc-per-node", "1", "--metrics-port", str(port), str(script), str(out),
                    str(stop)])
    try:
        wait_until(out.exists, 120, "the probe worker's report")
        assert ("127.0.0.1", port) in _listening([agent.pid])
        assert not any(p == port and ip != "127.0.0.1" for ip, p in _listening([agent.pid]))
    finally:
        stop.touch()
    assert agent.wait(60) == 0, agent.output()
