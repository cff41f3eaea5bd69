"""The round's c10d store without torch in the agent: a socket the agent binds, served by a store host.

Real sockets, real store host processes (``python -m elasticrun.launch.storeserver`` and children of
a real fork server), torch's own TCPStore clients, and a real job whose agent is checked for torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest

from elasticrun.launch.c10d import RoundStore
from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig
from elasticrun.launch.storeserver import ERROR_PREFIX
from elasticrun.launch.workers import WorkerGroup
from elasticrun.rendezvous.records import Member, Topology

from helpers.procs import Agent, wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: parent-death signals, /proc")]

TIMEOUT = timedelta(seconds=60)


def _client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _popen_host(fd: int, control: int) -> subprocess.Popen:
    """The store host without a fork server, as the worker group starts it."""
    return subprocess.Popen([sys.executable, "-m", "elasticrun.launch.storeserver", "--fd", str(fd),
                             "--control", str(control)],
                            pass_fds=(fd, control), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_each_round_gets_a_fresh_store_served_on_the_agents_socket() -> None:
    errors: List[str] = []
    rounds = RoundStore(timeout_s=60, on_error=errors.append)
    try:
        port = rounds.fresh()
        # The port accepts connections at once, before any store host exists: a worker that comes
        # early waits in the listen backlog, and its client then talks to the store once it is served.
        early = socket.create_connection(("127.0.0.1", port), timeout=5)
        early.close()
        assert rounds.serve(port, _popen_host)
        assert rounds.serve(port, _popen_host), "once per round: a second call starts nothing"
        first = _client(port)
        first.set("attempt", "0")
        assert _client(port).get("attempt") == b"0"

        again = rounds.fresh()
        assert again != port
        assert first.get("attempt") == b"0", "workers kept through the change still reach their round's store"
        assert rounds.serve(again, _popen_host)
        second = _client(again)
        assert second.check(["attempt"]) is False, "the new round's store holds nothing of the old one"
        assert not rounds.serve(port, _popen_host), "a port that is not this round's is never served"
        third = rounds.fresh()
        wait_until(lambda: _refused(port), 30, "the store of two rounds ago to be gone")
        assert third not in (port, again)
    finally:
        rounds.close()
    assert errors == [], "closing a store is not an error"


def test_the_next_round_a_node_leads_is_served_by_the_same_host_at_once() -> None:
    """No new process (no torch import) on a re-form's path: the host of the round before takes the new
    round's socket; the store two rounds old stops listening. A host that died meanwhile is replaced."""
    started: List[subprocess.Popen] = []

    def start(fd: int, control: int) -> subprocess.Popen:
        started.append(_popen_host(fd, control))
        return started[-1]

    errors: List[str] = []
    rounds = RoundStore(timeout_s=60, on_error=errors.append)
    try:
        first = rounds.fresh()
        assert rounds.serve(first, start)
        _client(first).set("round", "0")
        host = rounds.host
        second = rounds.fresh()
        assert rounds.host is None, "no round is served between fresh() and serve()"
        began = time.monotonic()
        assert rounds.serve(second, start)
        assert time.monotonic() - began < 0.5 and rounds.host is host and len(started) == 1, "the same host"
        client = _client(second)
        assert client.check(["round"]) is False, "the new round's store holds nothing of the old one"
        client.set("round", "1")
        assert _client(first).get("round") == b"0", "the previous round's store still answers"
        third = rounds.fresh()
        wait_until(lambda: _refused(first), 30, "the store of two rounds ago to stop listening")
        assert _client(second).get("round") == b"1", "the round ending now is kept through the change"

        host.kill()  # gone between rounds: not this round's host, so no error; the next serve starts anew
        host.wait(30)
        assert rounds.serve(third, start) and len(started) == 2 and rounds.host is started[1]
        _client(third).set("round", "2")
    finally:
        rounds.close()
    assert errors == [], errors


def test_a_host_another_node_replaced_is_killed_a_round_later() -> None:
    """The node led round 0, another node round 1: at round 2 its host (round 0's store) is killed."""
    started: List[subprocess.Popen] = []

    def start(fd: int, control: int) -> subprocess.Popen:
        started.append(_popen_host(fd, control))
        return started[-1]

    rounds = RoundStore(timeout_s=60)
    try:
        first = rounds.fresh()
        rounds.serve(first, start)
        _client(first).set("k", "v")
        rounds.fresh()  # round 1: led elsewhere, serve() never called here
        assert started[0].poll() is None, "round 0's store is kept through the change"
        rounds.fresh()
        # Gone either way: killed, or exited 0 by itself when its control socket closed just before the kill.
        assert started[0].wait(30) in (0, -signal.SIGKILL), "round 0's host is gone"
        assert _refused(first)
    finally:
        rounds.close()


def test_a_single_nodes_first_store_is_served_before_its_round() -> None:
    """A node that surely leads round 0 has its store served at start: round 0 gets that port, the
    next round a new one."""
    rounds = RoundStore(timeout_s=60)
    try:
        early = rounds.prepare(_popen_host)
        assert rounds.host is not None, "served before any round"
        _client(early).set("k", "v")
        assert rounds.fresh() == early, "the first round gets the prepared store"
        later = rounds.fresh()
        assert later != early
        rounds.fresh()
        wait_until(lambda: _refused(early), 30, "the first round's store to be gone a round later")
    finally:
        rounds.close()


def test_a_store_host_forked_from_the_fork_server_serves_at_once(tmp_path: Path) -> None:
    """Leading a round, the worker group hosts the store as a child of its fork server (bare here: the
    child imports torch itself); a node that does not lead never starts one."""
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=str(tmp_path / "unused.py"), nproc_per_node=1, standby=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    group.round_store = RoundStore(timeout_s=60)
    try:
        group.prewarm()
        server = group.server
        assert server is not None and server.wait_ready(120)
        port = group.round_store.fresh()
        follower = Member("n", "h", "127.0.0.1", 1, 1, 1)
        topo = Topology(round=0, members=(Member("m", "h", "127.0.0.1", 1, 0, 0), follower),
                        master_addr="127.0.0.1", master_port=port)
        group._serve_store(topo, follower, server)
        assert group.round_store.host is None, "not the round's group rank 0: no store host"
        leader = Member("n", "h", "127.0.0.1", 1, 0, 0)
        group._serve_store(Topology(round=0, members=(leader,), master_addr="127.0.0.1", master_port=port),
                           leader, server)
        host = group.round_store.host
        assert host is not None and os.getppid() != host.pid
        assert Path(f"/proc/{host.pid}/stat").read_text().split()[3] == str(server.proc.pid), "forked by the server"
        client = _client(port)
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        group.round_store.close()
        group.discard_warm()


def test_a_host_that_cannot_serve_is_one_line_for_the_agent(tmp_path: Path) -> None:
    """No traceback anywhere: the host prints one line and exits 2, the agent's callback gets that line."""
    not_a_socket = os.open(str(tmp_path / "plain-file"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        direct = subprocess.run([sys.executable, "-m", "elasticrun.launch.storeserver", "--fd", str(not_a_socket)],
                                pass_fds=(not_a_socket,), capture_output=True, text=True, timeout=120)
        assert direct.returncode == 2
        assert direct.stderr.startswith(ERROR_PREFIX) and len(direct.stderr.strip().splitlines()) == 1, direct.stderr

        errors: List[str] = []
        rounds = RoundStore(timeout_s=60, on_error=errors.append)
        port = rounds.fresh()

        def wrong_fd(_fd: int, control: int) -> subprocess.Popen:
            return _popen_host(not_a_socket, control)

        rounds.serve(port, wrong_fd)
        wait_until(lambda: errors, 120, "the host's error line")
        assert errors[0].startswith(ERROR_PREFIX), errors
        rounds.close()
    finally:
        os.close(not_a_socket)


def test_a_store_host_killed_mid_round_is_reported_once(tmp_path: Path) -> None:
    errors: List[str] = []
    rounds = RoundStore(timeout_s=60, on_error=errors.append)
    try:
        port = rounds.fresh()
        rounds.serve(port, _popen_host)
        _client(port).set("k", "v")  # serving
        os.kill(rounds.host.pid, signal.SIGKILL)
        wait_until(lambda: errors, 60, "the lost store to be reported")
        assert errors == [f"the round's c10d store host exited ({-signal.SIGKILL})"], errors
    finally:
        rounds.close()
    assert len(errors) == 1


# A worker that proves the store works (an all-reduce over gloo), says so, then holds until released.
HOLDING_WORKER = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
up = os.path.join(sys.argv[1], f"up{dist.get_rank()}")
with open(up + ".tmp", "w") as f:
    f.write(str(t.item()))
os.replace(up + ".tmp", up)  # whole when it appears: the test reads it as soon as it exists
while not os.path.exists(os.path.join(sys.argv[1], "release")):
    time.sleep(0.05)
dist.destroy_process_group()
"""


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_agent_of_a_running_job_maps_no_torch(tmp_path: Path, agents: Callable[..., Agent]) -> None:
    """Torch lives in the workers, the fork server and the store host; the agent never loads it."""
    script = tmp_path / "worker.py"
    script.write_text(HOLDING_WORKER)
    agent = agents(["--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)], name="agent")
    try:
        wait_until(lambda: all((tmp_path / f"up{r}").exists() for r in (0, 1)), 300,
                   f"both workers to meet through the store\n{agent.output()[-3000:]}")
        assert [(tmp_path / f"up{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
        assert "libtorch" not in _maps(agent.pid), "the agent loaded torch"
        torch_users = [p.pid for p in agent.descendants() if _mapped_torch(p.pid)]
        assert torch_users, "torch is somewhere below the agent (workers, store host)"
    finally:
        (tmp_path / "release").write_text("")
    assert agent.wait(180) == 0, agent.output()[-3000:]


def _mapped_torch(pid: int) -> Optional[bool]:
    try:
        return "libtorch" in _maps(pid)
    except OSError:
        return None


def test_a_round_port_needs_no_torch() -> None:
    """fresh() in a fresh interpreter: a port, and no torch module loaded to get it."""
    code = ("import sys; from elasticrun.launch.c10d import RoundStore; r = RoundStore(); p = r.fresh(); "
            "print(p, 'torch' in sys.modules); r.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    port, torch_loaded = out.stdout.split()
    assert int(port) > 0 and torch_loaded == "False"


# Attempt 0 holds after meeting (until its store host is killed); attempt 1 meets and exits.
STORE_LOSS_WORKER = """\
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
up = os.path.join(sys.argv[1], f"up{dist.get_rank()}-{attempt}")
with open(up + ".tmp", "w") as f:
    f.write(os.environ["MASTER_PORT"])
os.replace(up + ".tmp", up)  # whole when it appears
while attempt == "0":
    time.sleep(0.05)
dist.destroy_process_group()
"""


def _listener(agent: Agent, port: int) -> Optional[int]:
    """The process below ``agent`` that listens on ``port`` (the round's store host)."""
    for proc in agent.descendants():
        try:
            if any(c.status == "LISTEN" and c.laddr.port == port for c in proc.net_connections(kind="tcp")):
                return proc.pid
        except Exception:  # noqa: BLE001 - a process that went away meanwhile
            continue
    return None


def test_a_lost_store_fails_the_round_at_once_and_the_next_round_gets_a_new_one(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    """Without its store a round's workers could never meet again (and would wait for torch's store
    timeout): the agent says why, kills them, and the restart gets a fresh store host."""
    script = tmp_path / "worker.py"
    script.write_text(STORE_LOSS_WORKER)
    agent = agents(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script), str(tmp_path)],
                   name="agent")
    wait_until(lambda: all((tmp_path / f"up{r}-0").exists() for r in (0, 1)), 300,
               f"attempt 0 to meet\n{agent.output()[-3000:]}")
    port = int((tmp_path / "up0-0").read_text())
    host = wait_until(lambda: _listener(agent, port), 60, "the store host listening on MASTER_PORT")
    assert host != agent.pid
    os.kill(host, signal.SIGKILL)
    assert agent.wait(300) == 0, agent.output()[-3000:]
    err = agent.stderr()
    assert "the round's c10d store host exited" in err and "stopping this round's workers" in err, err
    assert int((tmp_path / "up0-1").read_text()) != port, "the restart's store is a new one"
