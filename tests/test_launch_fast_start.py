"""Launch path: nothing waits on etcd's start that need not (issue 12, target 2).

Real etcd processes (behind small wrapper executables that delay or refuse flags, as a slow disk or an
older etcd would), real agents and workers on gloo. Behaviour only: what starts before etcd answers, and
that everything started early still gets a correct environment. No timing thresholds.
"""

from __future__ import annotations

import json
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from elasticrun.job import env as names
from elasticrun.store.client import connect
from elasticrun.store.reach import wait_reachable
from elasticrun.store.server import NO_FSYNC_FLAG, EtcdServer, find_etcd_binary, free_port

from helpers.launch import run_cli

pytestmark = pytest.mark.integration  # starts etcd or processes

# The worker: was torch already imported when the script started (a preloaded interpreter)? Then the
# torchrun environment and one all_reduce, written to OUT/rank<R>.json.
WORKER = """\
import json, os, sys
prewarmed = "torch" in sys.modules
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "ELASTICRUN_RDZV_ENDPOINT", "ELASTICRUN_BACKEND")
row = {k: os.environ.get(k) for k in keys}
row.update(prewarmed=prewarmed, sum=t.item(), world=dist.get_world_size())
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(row, f)
dist.destroy_process_group()
"""

# An "etcd" that first records which of the job's worker interpreters are already running (their command
# line carries MARKER), and its own arguments, then waits a while (a slow disk, a busy host) and becomes
# the real etcd.
SLOW_ETCD = """\
#!{python}
import json, os, sys, time
import psutil
warm = []
for p in psutil.process_iter(["cmdline"]):
    cmd = p.info["cmdline"] or []
    if any({marker!r} in a for a in cmd) and any("elasticrun.launch.warm" in a for a in cmd):
        warm.append(p.pid)
with open({record!r}, "w") as f:
    json.dump({{"warm_before_etcd": warm, "argv": sys.argv[1:]}}, f)
time.sleep(1.5)
os.execv({etcd!r}, [{etcd!r}, *sys.argv[1:]])
"""

# An etcd older than 3.5: Go's flag package refuses --unsafe-no-fsync (error line, then usage, exit 2).
OLD_ETCD = """\
#!{python}
import os, sys
if any(a.lstrip("-") == "unsafe-no-fsync" for a in sys.argv[1:]):
    sys.stderr.write("flag provided but not defined: -unsafe-no-fsync\\nUsage:\\n\\n  etcd [flags]\\n")
    sys.exit(2)
os.execv({etcd!r}, [{etcd!r}, *sys.argv[1:]])
"""


def _executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("preload_first", ["0", "1"])
def test_workers_started_before_etcd_answers_get_a_correct_environment(tmp_path: Path, preload_first: str) -> None:
    marker = f"fast-start-{uuid.uuid4().hex[:8]}"
    record = tmp_path / "etcd-start.json"
    etcd = _executable(tmp_path / "slow_etcd", SLOW_ETCD.format(
        python=sys.executable, marker=marker, record=str(record), etcd=find_etcd_binary()))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(["--standalone", "--nproc-per-node", "2", "--etcd-binary", etcd, str(script), str(out), marker],
                   timeout=180, env={names.PRELOAD_FIRST: preload_first})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    started = json.loads(record.read_text())
    # The fork server was up while etcd had not even started.
    assert started["warm_before_etcd"], "no fork server was running when etcd started"
    # The private etcd is throw-away: started without fsync.
    assert NO_FSYNC_FLAG in started["argv"]
    rows = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: int(r["RANK"]))
    assert [r["RANK"] for r in rows] == ["0", "1"], rows
    endpoint = rows[0]["ELASTICRUN_RDZV_ENDPOINT"]
    for r in rows:
        # Bare: nothing imported torch for the first round's workers (torchrun's import nothing before the
        # script either); preload first (a host with few cores): forked once the server imported torch.
        assert r["prewarmed"] is (preload_first == "1"), r
        assert r["LOCAL_RANK"] == r["RANK"] and r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == "2"
        assert r["world"] == 2 and r["sum"] == 1.0  # all_reduce of ranks 0 + 1
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert r["ELASTICRUN_RDZV_ENDPOINT"] == endpoint  # the etcd that was started late
        assert r["ELASTICRUN_BACKEND"] == "gloo"
    assert len({r["MASTER_PORT"] for r in rows}) == 1


def _assert_serves(endpoint: str) -> None:
    store = connect(endpoint)
    try:
        store.put("/fast-start/k", b"v")
        kv = store.get("/fast-start/k")
        assert kv is not None and kv.value == b"v"
    finally:
        store.close()


def test_an_etcd_without_unsafe_no_fsync_is_started_with_fsync(tmp_path: Path) -> None:
    old = _executable(tmp_path / "etcd34", OLD_ETCD.format(python=sys.executable, etcd=find_etcd_binary()))
    server = EtcdServer(binary=old, unsafe_no_fsync=True)
    try:
        server.start(timeout=30)
        assert server.running()
        assert server.unsafe_no_fsync is False and NO_FSYNC_FLAG not in server.command()
        _assert_serves(server.endpoint)
    finally:
        server.stop()


def test_a_current_etcd_runs_without_fsync_and_serves(tmp_path: Path) -> None:
    server = EtcdServer(unsafe_no_fsync=True, data_dir=str(tmp_path / "data"))
    try:
        server.start(timeout=30)
        assert server.proc is not None and NO_FSYNC_FLAG in server.proc.args
        _assert_serves(server.endpoint)
    finally:
        server.stop()


def test_a_joining_agent_sees_the_hosts_etcd_port_open_as_soon_as_it_listens() -> None:
    port = free_port()
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(wait_reachable(f"127.0.0.1:{port}", 120.0)), daemon=True)
    waiter.start()
    with socket.socket() as listener:  # "etcd" starts listening while the joiner already waits
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        waiter.join(120.0)
    assert found == [None]


def test_waiting_for_a_port_nobody_opens_ends_at_the_timeout() -> None:
    started = time.monotonic()
    assert wait_reachable(f"127.0.0.1:{free_port()}", 0.3) == "connection refused"
    assert time.monotonic() - started < 2.0
