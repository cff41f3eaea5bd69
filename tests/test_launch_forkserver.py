"""The fork server: workers forked from one warmed interpreter behave like fresh `python script.py` ones.

Real processes throughout: a real server interpreter (torch imported), real forks, real pipes and signals.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

from elasticrun.launch import forkserver
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.forkserver import ForkedProcess, ForkServer, ServerState
from elasticrun.launch.workers import WorkerGroup
from elasticrun.rendezvous.records import Member, Topology

from helpers.launch import assert_one_line_error, run_cli
from helpers.procs import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

PROBE = '''
import json, os, sys
import numpy
out = os.environ["PROBE_OUT"]
with open(out, "w") as f:
    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(), "argv": sys.argv,
               "main": __name__, "file": __file__, "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
               "server_only": os.environ.get("SERVER_ONLY"), "np": float(numpy.random.random()),
               "stdin": sys.stdin.read()}, f)
print("out:" + os.environ["MARKER"])
print("err:" + os.environ["MARKER"], file=sys.stderr)
if os.environ.get("HOLD"):
    import time
    time.sleep(600)
sys.exit(int(os.environ.get("CODE", "0")))
'''


def _start(where: Path) -> ForkServer:
    (where / "probe.py").write_text(PROBE)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", SERVER_ONLY="1")
    fs = ForkServer([str(where / "probe.py")], env, str(where / "server.log"), str(where))
    assert fs.wait_ready(120), (fs.state, fs.why_gone, (where / "server.log").read_text())
    return fs


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """One server for the tests that leave it alive (its start imports torch: seconds on 2 cores)."""
    fs = _start(tmp_path_factory.mktemp("server"))
    yield fs
    fs.close()


@pytest.fixture
def server(shared_server: ForkServer, tmp_path: Path) -> ForkServer:
    (tmp_path / "probe.py").write_text(PROBE)  # the orders name this copy; the server's own is only a label
    return shared_server


def _order(tmp_path: Path, name: str, **extra: str) -> dict:
    env = {"PATH": os.environ.get("PATH", ""), "MARKER": name, "PROBE_OUT": str(tmp_path / f"{name}.json"), **extra}
    return {"env": env, "argv": [str(tmp_path / "probe.py"), "--flag", name], "module": False, "cwd": str(tmp_path)}


def test_forked_workers_run_the_script_like_a_fresh_interpreter(tmp_path: Path, server: ForkServer) -> None:
    a = server.spawn(_order(tmp_path, "a", CODE="3"))
    b = server.spawn(_order(tmp_path, "b"))
    assert a is not None and b is not None
    assert a.wait(60) == 3 and b.wait(60) == 0  # exit codes come back like Popen.returncode
    assert a.stdout.read() == b"out:a\n" and a.stderr.read() == b"err:a\n"  # type: ignore[union-attr]
    ra, rb = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    for rec, proc, name in ((ra, a, "a"), (rb, b, "b")):
        assert rec["pid"] == proc.pid == rec["pgid"], "a worker leads its own process group (the agent signals it)"
        assert rec["ppid"] == server.proc.pid
        assert rec["argv"] == [str(tmp_path / "probe.py"), "--flag", name]
        assert rec["main"] == "__main__" and rec["file"] == str(tmp_path / "probe.py")
        assert rec["cwd"] == str(tmp_path) and rec["marker"] == name
        assert rec["server_only"] is None, "the worker's environment is the order's, not the server's"
        assert rec["stdin"] == "", "stdin is /dev/null, not the server's socket"
    assert ra["np"] != rb["np"], "numpy's global generator must differ per worker, as in fresh interpreters"


def test_a_signalled_worker_and_a_dead_server_are_reported(tmp_path: Path) -> None:
    server = _start(tmp_path)
    held = server.spawn(_order(tmp_path, "held", HOLD="1"))
    other = server.spawn(_order(tmp_path, "other", HOLD="1"))
    assert held is not None and other is not None
    wait_until(lambda: (tmp_path / "held.json").exists() and (tmp_path / "other.json").exists(), 60, "workers up")
    os.kill(held.pid, signal.SIGKILL)
    assert held.wait(30) == -signal.SIGKILL
    server.proc.kill()  # the server's children die with it, and their waiters hear of it
    assert other.wait(30) == -signal.SIGKILL
    wait_until(lambda: not Path(f"/proc/{other.pid}").exists() or _zombie(other.pid), 30, "the orphan gone")
    assert server.state is ServerState.GONE
    assert server.spawn(_order(tmp_path, "late")) is None
    server.close()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_big_order_goes_through_a_private_file(tmp_path: Path, server: ForkServer) -> None:
    order = _order(tmp_path, "big")
    order["argv"] += ["x" * 4000 for _ in range(50)]  # 200 KiB: more than one packet
    proc = server.spawn(order)
    assert proc is not None and proc.wait(60) == 0
    assert json.loads((tmp_path / "big.json").read_text())["argv"] == order["argv"]
    assert not list(tmp_path.glob("order-*.json")), "the order file is removed once read"


def test_a_server_that_started_a_thread_is_not_forked_from(tmp_path: Path) -> None:
    """An import that starts a thread makes fork unsafe: the group falls back to spawned standbys."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cfg = LaunchConfig(entrypoint=str(script), nproc_per_node=1, standalone=True, standby=1)
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(site)
    try:
        group.prewarm()
        server = group.server
        assert server is not None
        assert not server.wait_ready(120)
        assert "threads" in server.why_gone, server.why_gone
        group.prewarm()  # now: one spawned standby (--standby 1), no second server
        assert group.server is None and len(group._warm) == 1
        proc = group._spawn(dict(os.environ, **_order(tmp_path, "fallback")["env"]))
        assert proc.wait(120) == 0
        assert group._how["pre-warmed"] == 1
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        group.discard_warm()


def test_a_negative_standby_count_is_one_clear_error() -> None:
    assert_one_line_error(run_cli(["--standby", "-1", "--standalone", "train.py"], timeout=60), "--standby -1",
                          "0 or more")


HOLDER = '''
import os, time
with open(os.path.join(os.environ["HOLD_DIR"], f"rank{os.environ['RANK']}.{os.getpid()}"), "w"):
    pass
time.sleep(600)
'''


def _ranks_alive(marker: str) -> List[Tuple[int, int]]:
    """(RANK, pid) of every living worker (a RANK set) whose environment has ``HOLD_MARKER=marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if env.get(b"HOLD_MARKER") == marker.encode() and b"RANK" in env and not _zombie(int(entry)):
            found.append((int(env[b"RANK"]), int(entry)))
    return sorted(found)


def test_a_fork_that_times_out_closes_the_server_before_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow server's late child would run next to its replacement (same RANK), and closing the
    server later would kill the round's workers forked from it: it is closed before the fallback."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    marker = f"hold-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv("HOLD_DIR", str(tmp_path))
    monkeypatch.setenv("HOLD_MARKER", marker)
    monkeypatch.setattr(forkserver, "FORK_TIMEOUT_S", 1.5, raising=False)
    cfg = LaunchConfig(entrypoint=str(script), nproc_per_node=2, standalone=True, standby=1)
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    group.prewarm()
    server = group.server
    assert server is not None and server.wait_ready(120), server.why_gone if server else None
    original = server.spawn
    orders: List[dict] = []

    def slow_after_the_first(order: dict, timeout: Optional[float] = None) -> Optional[ForkedProcess]:
        if orders:
            os.kill(server.proc.pid, signal.SIGSTOP)  # a server that stops answering (load, swap, a stuck import)
        orders.append(order)
        return original(order) if timeout is None else original(order, timeout)

    monkeypatch.setattr(server, "spawn", slow_after_the_first)
    member = Member("n", "h", "127.0.0.1", 2, 0, 0)
    topo = Topology(round=0, members=(member,), master_addr="127.0.0.1", master_port=1)
    try:
        group.start(topo, member, None)
        assert len(orders) == 2
        assert server.proc.poll() is not None, "the server that timed out is still alive: a late fork can come"
        try:
            os.kill(server.proc.pid, signal.SIGCONT)  # were it alive, it would fork the late child now
        except ProcessLookupError:
            pass
        pids = sorted(group.pids)
        wait_until(lambda: len(list(tmp_path.glob("rank*.*"))) >= 2, 60, "both workers started")
        group.discard_warm()  # closing every server must not touch this round's workers
        assert all(w.proc.poll() is None for w in group._workers), "a worker died with a closed fork server"
        alive = _ranks_alive(marker)
        assert [r for r, _ in alive] == [0, 1], f"one worker per RANK expected, found {alive}"
        assert sorted(p for _, p in alive) == pids
    finally:
        try:
            os.kill(server.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        group.stop(5)
        group.discard_warm()
