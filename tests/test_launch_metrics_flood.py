"""The /metrics endpoint under hostile clients: a flood of half-sent requests against a real agent
costs it no threads, a real scrape still answers at once, and the slow clients are cut off at the
read deadline; the server's own bounds (deadline, eviction, bad requests) with small limits."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

from elasticrun.launch.httpserve import READ_TIMEOUT_S, BoundedHTTPServer

from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

FLOOD = 300
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: agent\r\nAccept: */*\r\n"  # no blank line: never ends

WAITER = """\
import os, sys, time
deadline = time.monotonic() + 300
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int, timeout: float) -> Tuple[float, str]:
    """(seconds taken, body) of one GET /metrics."""
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        body = resp.read().decode()
    return time.monotonic() - t0, body


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _half_open(port: int, n: int) -> List[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(HALF_REQUEST)
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the server closed ``s`` (end of stream or reset); False while it is still open."""
    s.setblocking(False)
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_flood_of_half_sent_requests_costs_no_threads_and_scrapes_still_answer(
    tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    port = _free_port()
    stop = tmp_path / "stop"
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    agent = agents(["--standalone", "--nproc-per-node", "1", "--metrics-port", str(port), str(script), str(stop)])
    socks: List[socket.socket] = []
    try:
        wait_until(lambda: _running(port), 120, "the agent's round to run its worker")
        baseline = _steady_threads(agent.pid)
        socks = _half_open(port, FLOOD)
        # every connection is accepted or queued by now; give the agent a moment to take them
        peak = 0
        for _ in range(20):
            peak = max(peak, _threads(agent.pid))
            time.sleep(0.05)
        took, body = _scrape(port, timeout=10)
        assert "elasticrun_world_size" in body
        assert took < 3.0, f"a scrape under a flood of {FLOOD} slow clients took {took:.2f} s"
        assert peak <= baseline + 2, f"{FLOOD} half-open connections grew the agent from {baseline} to {peak} threads"
        # the server cuts every slow client off at its read deadline (or earlier, to make room)
        wait_until(lambda: all(_closed_by_peer(s) for s in socks), READ_TIMEOUT_S + 30,
                   "the agent to close every half-open connection")
        took, _ = _scrape(port, timeout=10)
        assert took < 3.0
        assert agent.proc.poll() is None, agent.output()
    finally:
        for s in socks:
            s.close()
        stop.touch()
    assert agent.wait(60) == 0, agent.output()


def _running(port: int) -> bool:
    try:
        body = _scrape(port, timeout=5)[1]
    except OSError:
        return False
    return any(line.startswith("elasticrun_world_size{") and line.endswith(" 1.0") for line in body.splitlines())


def _steady_threads(pid: int) -> int:
    """The agent's thread count once it stopped changing for 3 s (its round started, and the fork server's
    preload of DDP's modules, ordered once the worker imported them, was handed over)."""
    seen: List[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < 30 or len(set(seen[-30:])) > 1:
        assert time.monotonic() < deadline, f"the agent's thread count never settled: {seen}"
        seen.append(_threads(pid))
        time.sleep(0.1)
    return seen[-1]


# -- the server's bounds, with small limits ---------------------------------------------------------

def _hello(method: str, path: str, headers: dict) -> Tuple[str, List[Tuple[str, str]], bytes]:
    if path == "/boom":
        raise RuntimeError("collector broke")
    return "200 OK", [("Content-Type", "text/plain")], f"{method} {path} {headers.get('accept', '-')}\n".encode()


BoundedHTTPServerFixture = Callable[..., Tuple[BoundedHTTPServer, int]]


@pytest.fixture
def server() -> Iterator[BoundedHTTPServerFixture]:
    made: List[BoundedHTTPServer] = []

    def make(**kw: float) -> Tuple[BoundedHTTPServer, int]:
        srv = BoundedHTTPServer(_hello, **kw)  # type: ignore[arg-type]
        made.append(srv)
        return srv, srv.start("127.0.0.1", 0)

    yield make
    for srv in made:
        srv.close()


def _exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_answers_get_and_head_and_refuses_what_is_not_http(server: BoundedHTTPServerFixture) -> None:
    srv, port = server()
    got = _exchange(port, b"GET /metrics?x=1 HTTP/1.1\r\nAccept: text/plain\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nGET /metrics text/plain\n")
    assert b"Content-Length: 24\r\n" in got and b"Connection: close\r\n" in got
    head = _exchange(port, b"HEAD / HTTP/1.0\n\n")  # bare LF line ends too
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n") and b"Content-Length: 9\r\n" in head
    assert _exchange(port, b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _exchange(port, b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _exchange(port, b"GET /boom HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500 ")
    wait_until(lambda: srv.counts.bad == 2 and srv.counts.served == 3, 10, f"the server to count them: {srv.counts}")


def test_a_trickling_client_is_cut_off_at_the_read_deadline(server: BoundedHTTPServerFixture) -> None:
    srv, port = server(read_timeout=1.0)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        closed_at: Optional[float] = None
        for byte in HALF_REQUEST:  # one byte every 0.1 s: each arrives well within any per-read timeout
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - t0
                break
            if _closed_by_peer(s):
                closed_at = time.monotonic() - t0
                break
            s.setblocking(True)
            time.sleep(0.1)
    assert closed_at is not None and 0.9 <= closed_at < 3.0, closed_at
    wait_until(lambda: srv.counts.timed_out == 1 and srv.open_connections == 0, 10, "the server to count it")


def test_past_the_cap_the_oldest_half_open_connection_makes_room(server: BoundedHTTPServerFixture) -> None:
    srv, port = server(max_connections=4, read_timeout=60.0)
    socks = _half_open(port, 10)
    try:
        wait_until(lambda: srv.counts.evicted == 6, 10, "six evictions")
        assert srv.open_connections == 4 and srv.counts.peak_open == 4
        assert [_closed_by_peer(s) for s in socks] == [True] * 6 + [False] * 4
        assert _exchange(port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    finally:
        for s in socks:
            s.close()


def test_a_large_answer_reaches_a_slow_reader_whole(server: BoundedHTTPServerFixture) -> None:
    """The connection closes only once the whole answer is sent: a reader that takes its time (but
    less than the write deadline) gets every byte of a body larger than the socket buffers."""
    big = b"x" * (16 << 20)
    srv, port = server()
    srv.handler = lambda method, path, headers: ("200 OK", [("Content-Type", "text/plain")], big)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        time.sleep(0.5)  # the server has written what the buffers hold, the rest waits in its transport
        got = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    assert got.endswith(big) and len(got.split(b"\r\n\r\n", 1)[1]) == len(big)


def test_every_interface_of_both_families_with_double_colon() -> None:
    srv = BoundedHTTPServer(_hello)
    port = srv.start("::", 0)
    try:
        for host in ("127.0.0.1", "::1"):
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 200 OK"), host
    finally:
        srv.close()
