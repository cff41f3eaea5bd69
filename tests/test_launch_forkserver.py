"""The fork server: workers forked from one interpreter behave like fresh `python script.py` ones.

Real processes throughout: a real server interpreter (bare, then torch preloaded), real forks, real
pipes and signals.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest

from elasticrun.job import env as names
from elasticrun.launch import forkserver
from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig
from elasticrun.launch.forkserver import ForkedProcess, ForkServer, ServerState
from elasticrun.launch.workers import WorkerGroup
from elasticrun.rendezvous.records import Member, Topology

from helpers.launch import assert_one_line_error, run_cli
from helpers.procs import wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")]

PROBE = '''
import json, os, sys
loaded = sorted(m for m in ("torch", "torch.distributed", "torch._dynamo", "numpy") if m in sys.modules)
import numpy
if os.environ.get("DYNAMO"):  # what DDP's first use imports
    import torch._dynamo
out = os.environ["PROBE_OUT"]
with open(out, "w") as f:
    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(), "argv": sys.argv, "loaded": loaded,
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


PRELOADED = ("torch", "torch.distributed", "torch._dynamo")


@pytest.fixture(autouse=True)
def bare_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker groups here start their server bare, as on a host with cores to spare (this one has two:
    ``auto`` would preload first); the tests of the preload-first path set it themselves."""
    monkeypatch.setenv(names.PRELOAD_FIRST, "0")


def _new_server(where: Path, preload_first: bool = False) -> ForkServer:
    (where / "probe.py").write_text(PROBE)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", SERVER_ONLY="1")
    return ForkServer([str(where / "probe.py")], env, str(where / "server.log"), str(where),
                      preload_first=preload_first)


def _loaded_by(fs: ForkServer, where: Path, name: str) -> List[str]:
    """Fork the probe as ``name``; which of torch's modules it found imported."""
    child = fs.spawn(_order(where, name))
    assert child is not None and child.wait(60) == 0
    return json.loads((where / f"{name}.json").read_text())["loaded"]


def _start(where: Path, preload: bool = True) -> ForkServer:
    fs = _new_server(where)
    assert fs.wait_ready(120), (fs.state, fs.why_gone, (where / "server.log").read_text())
    if preload:
        assert fs.preload()
        assert fs.wait_ready(300) and fs.warm, (fs.state, fs.why_gone, (where / "server.log").read_text())
    return fs


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """One preloaded server for the tests that leave it alive (its preload imports torch: seconds on 2 cores)."""
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
        assert set(PRELOADED) <= set(rec["loaded"]), "the preloaded modules"
    assert ra["np"] != rb["np"], "numpy's global generator must differ per worker, as in fresh interpreters"


def test_a_bare_server_forks_what_a_fresh_interpreter_is_then_preloads(tmp_path: Path) -> None:
    """Until the preload the server has imported nothing a worker would not: its first workers import
    torch themselves, as torchrun's do. A worker that exits while the server preloads (on a thread) is
    reported at once, not after the preload."""
    server = _start(tmp_path, preload=False)
    try:
        assert server.state is ServerState.READY and not server.warm
        bare = server.spawn(_order(tmp_path, "bare"))
        held = server.spawn(_order(tmp_path, "held", HOLD="1"))
        assert bare is not None and held is not None and bare.wait(60) == 0
        assert json.loads((tmp_path / "bare.json").read_text())["loaded"] == []
        wait_until(lambda: (tmp_path / "held.json").exists(), 60, "the held worker up")
        assert server.preload() and server.state is ServerState.PRELOADING
        assert server.spawn(_order(tmp_path, "early")) is None, "no fork while it preloads"
        os.kill(held.pid, signal.SIGKILL)
        assert held.wait(30) == -signal.SIGKILL
        assert server.state is ServerState.PRELOADING, "the exit came only after the preload"
        assert server.wait_ready(300) and server.warm and server.preload_s, server.why_gone
        assert not server.preload(), "once is enough"
        assert set(PRELOADED) <= set(_loaded_by(server, tmp_path, "warm"))
    finally:
        server.close()


def test_a_server_that_preloads_first_forks_with_torch_then_takes_ddps_extras(tmp_path: Path) -> None:
    """On a host with few cores the server imports torch as it starts (not DDP's extras: they would delay
    the first round by a second more); nothing is forked before, everything after has torch; the rest comes
    with a second, deep preload."""
    fs = _new_server(tmp_path, preload_first=True)
    try:
        assert fs.state is ServerState.PRELOADING and fs.preload_first, "ordered as it starts"
        assert fs.spawn(_order(tmp_path, "early")) is None, "no fork before torch is in"
        assert fs.wait_ready(300) and fs.warm and not fs.deep, (fs.state, fs.why_gone)
        loaded = _loaded_by(fs, tmp_path, "first")
        assert {"torch", "torch.distributed"} <= set(loaded) and "torch._dynamo" not in loaded, loaded
        assert not fs.preload(deep=False), "torch is in already"
        assert fs.preload() and fs.wait_ready(300) and fs.deep, (fs.state, fs.why_gone)
        assert not fs.preload(), "everything is in"
        assert set(PRELOADED) <= set(_loaded_by(fs, tmp_path, "later"))
    finally:
        fs.close()


@pytest.mark.parametrize("first", ["1", "0"])
def test_the_first_round_waits_for_a_server_that_preloads_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """``ELASTICRUN_PRELOAD_FIRST=1`` (``auto`` on a host with fewer cores than workers + 2): the first round's
    worker is forked once torch is in, and imports nothing itself; ``0``: it is started at once, from the
    bare server or fresh while that starts, and imports torch itself."""
    monkeypatch.setenv(names.PRELOAD_FIRST, first)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("MARKER", "w")
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "w.json"))
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(script), nproc_per_node=1, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    member = Member("n", "h", "127.0.0.1", 1, 0, 0)
    try:
        group.prewarm(preload=False)
        assert group.server is not None and group.server.preload_first is (first == "1")
        group.start(Topology(round=0, members=(member,), master_addr="127.0.0.1", master_port=1), member, None)
        wait_until(lambda: group._workers[0].proc.poll() is not None, 120, "the worker's probe")
        loaded = json.loads((tmp_path / "w.json").read_text())["loaded"]
        if first == "1":
            assert group._how["forked"] == 1 and {"torch", "torch.distributed"} <= set(loaded), (group.started_how,
                                                                                              loaded)
        else:
            assert loaded == [], f"a bare start imports nothing before the script: {loaded} ({group.started_how})"
    finally:
        group.stop(5)
        group.discard_warm()


def test_the_server_takes_ddps_extras_only_once_a_forked_worker_used_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that never imports torch._dynamo leaves the server with torch alone (~1.5 CPU-s a node
    saved); once a forked worker imports it (warm.py marks it), the next preload takes it too."""
    monkeypatch.setenv(names.PRELOAD_FIRST, "1")
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.setenv("HOLD", "1")
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(tmp_path / "probe.py"), nproc_per_node=1, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    member = Member("n", "h", "127.0.0.1", 1, 0, 0)
    try:
        group.prewarm(preload=False)
        for round_, dynamo in ((0, ""), (1, "1")):
            monkeypatch.setenv("DYNAMO", dynamo)
            monkeypatch.setenv("MARKER", f"r{round_}")
            monkeypatch.setenv("PROBE_OUT", str(tmp_path / f"r{round_}.json"))
            group.start(Topology(round=round_, members=(member,), master_addr="127.0.0.1", master_port=1), member,
                        None)
            probe = tmp_path / f"r{round_}.json"
            wait_until(probe.exists, 120, "the worker past its imports")
            group.prewarm()  # as when a node joins: preload now whatever is left to preload
            server = group.server
            assert server is not None and server.wait_ready(300) and server.warm, (server.state, server.why_gone)
            assert server.deep is bool(dynamo), f"round {round_}: DDP's extras preloaded: {server.deep}"
            group.stop(5)
    finally:
        group.stop(5)
        group.discard_warm()


# Makes the preload start a thread (as a library that starts a pool at import would).
THREAD_ON_PRELOAD = """\
import sys, threading, time
class _StartsAThread:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        return None
sys.meta_path.insert(0, _StartsAThread())
"""


def test_a_preload_that_starts_a_thread_stops_the_forks_but_keeps_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forking is unsafe after such a preload: the server forks no more, but the round's workers it
    forked before keep running (it stays alive and reports their exits), and the group falls back to
    spawned standbys."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREAD_ON_PRELOAD)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(script), nproc_per_node=1, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *([old] if old else [])]))
    try:
        group.prewarm()
        server = group.server
        assert server is not None and server.wait_ready(120) and not server.warm
        held = server.spawn(_order(tmp_path, "held", HOLD="1"))
        assert held is not None
        wait_until(lambda: (tmp_path / "held.json").exists(), 60, "the held worker up")
        assert server.preload()
        assert not server.wait_ready(300)
        assert "threads after the preload" in server.why_gone, server.why_gone
        assert held.poll() is None and server.proc.poll() is None, "the server and its worker live on"
        os.kill(held.pid, signal.SIGKILL)
        assert held.wait(30) == -signal.SIGKILL, "the server still reports its children's exits"
        group.prewarm()  # now: one spawned standby (--standby 1), no second server
        assert group.server is None and len(group._warm) == 1
    finally:
        group.discard_warm()


def test_a_signalled_worker_and_a_dead_server_are_reported(tmp_path: Path) -> None:
    server = _start(tmp_path, preload=False)
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


def test_a_server_that_started_a_thread_is_not_forked_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import that starts a thread makes fork unsafe: the group falls back to spawned standbys."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import threading, time\n"
                                           "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(script), nproc_per_node=1, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    monkeypatch.setenv("PYTHONPATH", str(site))
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
        group.discard_warm()


def test_a_negative_standby_count_is_one_clear_error() -> None:
    assert_one_line_error(run_cli(["--standby", "-1", "--standalone", "train.py"], timeout=60), "--standby '-1'",
                          "0 or more")


def test_a_bad_preload_first_value_is_one_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    proc = run_cli(["--standalone", "--nproc-per-node", "1", str(script)], timeout=60,
                   env={names.PRELOAD_FIRST: "yes"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "never runs" not in proc.stdout
    assert_one_line_error(proc, f"{names.PRELOAD_FIRST}='yes'", "use 1, 0 or auto")


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
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(script), nproc_per_node=2, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    group.prewarm()
    server = group.server
    assert server is not None and server.wait_ready(120), server.why_gone if server else None
    original = server.spawn
    orders: List[dict] = []

    def slow_after_the_first(order: dict, timeout: Optional[float] = None, fds: Sequence[int] = ()) -> Optional[
            ForkedProcess]:
        if orders:
            os.kill(server.proc.pid, signal.SIGSTOP)  # a server that stops answering (load, swap, a stuck import)
        orders.append(order)
        return original(order, timeout, fds)

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
