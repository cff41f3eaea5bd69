"""A small bounded HTTP server for the agent's read-only endpoint (``/metrics``).

One thread runs an asyncio loop that serves every connection: an open connection costs a socket
and a coroutine, never a thread, so no number of clients can grow the agent's thread count.
Each connection must send its whole request head within :data:`READ_TIMEOUT_S` (a client that
trickles bytes or stops half-way is closed) and take its answer within :data:`WRITE_TIMEOUT_S`;
it gets one answer and is closed (``Connection: close``, as HTTP/1.0). At most
:data:`MAX_CONNECTIONS` are open at once: one more closes the oldest connection that has not
finished sending its request (a flood of half-open clients cannot keep a scraper out: a scraper
sends its request at once and is answered at the next turn of the loop), or, when every open one
is already being answered, is closed at once.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

READ_TIMEOUT_S = 5.0  # to send the request line and headers, from the connection's accept
WRITE_TIMEOUT_S = 10.0  # to take the answer
MAX_CONNECTIONS = 64  # open at once
MAX_HEAD_BYTES = 16 * 1024  # request line and headers together
BACKLOG = 128  # the kernel's queue of connections not accepted yet

#: What the server asks of its application: (method, path without query, lower-cased headers)
#: -> (status line such as ``"200 OK"``, response headers, body).
Handler = Callable[[str, str, Dict[str, str]], Tuple[str, List[Tuple[str, str]], bytes]]


class _BadRequest(Exception):
    """The request head cannot be read as HTTP."""


@dataclass
class Counts:
    """What the server did since it started (tests and benches read it)."""

    served: int = 0
    timed_out: int = 0  # closed for not sending the request, or not taking the answer, in time
    evicted: int = 0  # closed to make room for a newer connection
    refused: int = 0  # closed at once: every open connection was being answered
    bad: int = 0  # not HTTP, or a head over MAX_HEAD_BYTES
    peak_open: int = 0


@dataclass
class _Conn:
    writer: asyncio.StreamWriter
    reading: bool = True  # still reading the request head (may be evicted)
    closed: bool = field(default=False)


class BoundedHTTPServer:
    """Serves ``handler`` on one daemon thread, with the bounds above (keyword arguments override them)."""

    def __init__(self, handler: Handler, *, name: str = "elasticrun-http", max_connections: int = MAX_CONNECTIONS,
                 read_timeout: float = READ_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S) -> None:
        self.handler = handler
        self.name = name
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.counts = Counts()
        self._conns: OrderedDict[asyncio.Task[None], _Conn] = OrderedDict()  # oldest first
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (``port`` 0: any free one) and serve from a daemon thread; the port
        bound. OSError when the address cannot be bound (raised here, in the caller's thread)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()  # "::": IPv4 clients too, as "0.0.0.0" is
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG, dualstack_ipv6=dualstack)
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()
        failed: List[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._client, sock=sock, limit=MAX_HEAD_BYTES, backlog=BACKLOG))
            except BaseException as err:  # noqa: BLE001 - reported to start()'s caller
                failed.append(err)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not started.wait(30) or failed:
            self._loop = self._thread = None
            sock.close()
            raise OSError(f"the HTTP server did not start: {failed[0] if failed else 'no answer in 30 s'}")
        return int(sock.getsockname()[1])

    def close(self, wait: float = 5.0) -> None:
        """Stop listening, close every connection, end the thread (waits up to ``wait`` s)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(wait)
        except Exception:  # noqa: BLE001 - the loop already ended, or it is stuck: the thread is a daemon
            pass
        thread.join(wait)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- the loop's side ---------------------------------------------------------------------

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task, conn in list(self._conns.items()):
            self._drop(conn)
            task.cancel()
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn`` at once, discarding what it has not sent (a slow, evicted or failed client)."""
        if not conn.closed:
            conn.closed = True
            conn.writer.transport.abort()

    def _admit(self, task: asyncio.Task[None], conn: _Conn) -> bool:
        """Make room for ``conn``: evict the oldest connection still reading, or refuse ``conn``."""
        if len(self._conns) >= self.max_connections:
            oldest = next(((t, c) for t, c in self._conns.items() if c.reading), None)
            if oldest is None:
                self.counts.refused += 1
                return False
            self.counts.evicted += 1
            self._drop(oldest[1])
            oldest[0].cancel()
            del self._conns[oldest[0]]
        self._conns[task] = conn
        self.counts.peak_open = max(self.counts.peak_open, len(self._conns))
        return True

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Conn(writer)
        if not self._admit(task, conn):
            self._drop(conn)
            return
        try:
            await self._serve(reader, conn)
        except (asyncio.TimeoutError, TimeoutError):
            self.counts.timed_out += 1
        except (_BadRequest, asyncio.LimitOverrunError, ValueError):
            self.counts.bad += 1
            await self._answer(conn, "400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went away, or it was evicted / the server is closing
        finally:
            self._conns.pop(task, None)
            self._drop(conn)

    async def _serve(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        method, path, headers = await asyncio.wait_for(_read_head(reader), self.read_timeout)
        conn.reading = False
        try:
            status, extra, body = self.handler(method, path, headers)
        except Exception as err:  # noqa: BLE001 - a broken collector answers 500, never ends the server
            status, extra, body = "500 Internal Server Error", [("Content-Type", "text/plain")], \
                f"error: {type(err).__name__}: {err}\n".encode()
        if method == "HEAD":
            extra = [*extra, ("Content-Length", str(len(body)))]
            body = b""
        await self._answer(conn, status, extra, body)
        self.counts.served += 1

    async def _answer(self, conn: _Conn, status: str, headers: List[Tuple[str, str]], body: bytes) -> None:
        if conn.closed:
            return
        names = {k.lower() for k, _ in headers}
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers), "Connection: close"]
        if "content-length" not in names:
            lines.append(f"Content-Length: {len(body)}")
        conn.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        conn.writer.close()  # after the buffered bytes are sent (an abort would drop them)
        await asyncio.wait_for(conn.writer.wait_closed(), self.write_timeout)
        conn.closed = True


async def _read_head(reader: asyncio.StreamReader) -> Tuple[str, str, Dict[str, str]]:
    """The request line and headers (CRLF or LF line ends); _BadRequest when they are not HTTP."""
    size = 0
    lines: List[str] = []
    while True:
        line = await reader.readuntil(b"\n")
        size += len(line)
        if size > MAX_HEAD_BYTES:
            raise _BadRequest("request head too large")
        text = line.decode("latin-1").rstrip("\r\n")
        if not text:
            if lines:
                break
            continue  # blank lines before the request line are allowed (RFC 9112 2.2)
        lines.append(text)
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _BadRequest(f"not an HTTP request line: {lines[0][:80]!r}")
    headers: Dict[str, str] = {}
    for text in lines[1:]:
        name, sep, value = text.partition(":")
        if not sep:
            raise _BadRequest(f"not a header: {text[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return parts[0].upper(), parts[1].split("?", 1)[0], headers


__all__ = ["BoundedHTTPServer", "Counts", "Handler", "MAX_CONNECTIONS", "READ_TIMEOUT_S", "WRITE_TIMEOUT_S"]
