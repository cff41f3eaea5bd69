"""The c10d store of each round this node leads (``TORCHELASTIC_USE_AGENT_STORE=True``), without torch.

Every round gets a brand-new store on a port the OS picks, so no restarted worker can read a
previous attempt's keys (torch does not prefix per attempt when the agent hosts the store) and
there is no free-port race: the port is bound before it is published.

The agent binds and listens on that port itself (:meth:`RoundStore.fresh`: instant, so the node
is ready for the round at once) and keeps the socket until the round forms. Only when this node
leads the round (its group rank 0, whose address and port are the round's ``MASTER_ADDR`` and
``MASTER_PORT``) does it hand the socket to a store host process (:meth:`RoundStore.serve`,
:mod:`elasticrun.launch.storeserver`), which runs torch's ``TCPStore`` on it; the other nodes
never pay a torch import for a store nobody uses. Workers that connect before the host serves
wait in the listen backlog. When the node leads the next round too, the same host serves that
round's store as well (sent over a control socket: no new process, no torch import on the
re-form's path). The store of the round before the previous one is always gone: the host drops
it (it stops listening), or, when another node led in between, the host is killed.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Optional, Tuple

from elasticrun.launch.storeserver import RETIRE, SERVE

# Connections the kernel queues before the host accepts them (it caps this at net.core.somaxconn);
# every worker of the job connects to the round's store, all at once at the round's start.
LISTEN_BACKLOG = 4096
HOST_WAIT_S = 5.0  # how long closing waits for a killed store host to be reaped

# (the listening fd, the host's end of its control socket) -> a started process (Popen-like: poll, wait, kill, stderr)
StartHost = Callable[[int, int], Any]


def listening_socket() -> socket.socket:
    """A TCP socket listening on a port the OS picks, on every address (IPv6 and IPv4 where the
    host has IPv6, as torch's own store listens), not inherited by child processes."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        sock = None
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
        except OSError:
            sock.close()
            sock = None
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
    sock.listen(LISTEN_BACKLOG)
    return sock


class RoundStore:
    """At most one round's store at a time: a listening socket here, then (leading) its host process.

    ``on_error`` gets one line when a host exits on its own while its round is current (it could
    not serve, or was killed): that round's workers can no longer meet.
    """

    def __init__(self, timeout_s: float = 900.0, on_error: Optional[Callable[[str], None]] = None) -> None:
        self.timeout_s = timeout_s
        self._on_error = on_error or (lambda _line: None)
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._port = 0
        # The host and our end of its control socket. It serves the current round's store when
        # _current; else the previous round's, kept until the next round's store is bound (workers
        # kept through a round change, in-place re-forming, may still use it until they re-form).
        self._host: Any = None
        self._control: Optional[socket.socket] = None
        self._current = False
        self._prepared = False  # bound (and served) ahead of the first round: fresh() hands it out once

    @property
    def port(self) -> int:
        """The current round's port (0 before the first :meth:`fresh`)."""
        return self._port

    @property
    def host(self) -> Any:
        """The process serving the current round's store, once :meth:`serve` has it served."""
        return self._host if self._current else None

    def prepare(self, start_host: StartHost) -> int:
        """Bind the first round's store now and have it served at once, for a node that surely leads
        that round (a single-node job): its host imports torch while the agent starts etcd, not while
        the round's workers start. The next :meth:`fresh` hands out this port (nobody has seen it yet,
        so it is as fresh as a new one)."""
        port = self.fresh()
        self.serve(port, start_host)
        with self._lock:
            self._prepared = True
        return port

    def fresh(self) -> int:
        """Bind a new round's store, return its port. The current round's store is served on until the
        round after (workers kept through the change still use it until they re-form); the one before
        it is dropped now (its host killed if it served no later round)."""
        with self._lock:
            if self._prepared:
                self._prepared = False
                return self._port
            stale: Tuple[Any, Optional[socket.socket]] = (None, None)
            if self._current:
                self._order(RETIRE)  # it keeps the ending round's store only
                self._current = False
            elif self._host is not None:  # another node led the round ending now: its store is two rounds old
                stale, self._host, self._control = (self._host, self._control), None, None
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        _kill(*stale)
        sock = listening_socket()
        with self._lock:
            self._sock, self._port = sock, int(sock.getsockname()[1])
            return self._port

    def serve(self, port: int, start_host: StartHost) -> bool:
        """Have the store bound on ``port`` (the round's ``MASTER_PORT``) served: by the host of an
        earlier round where it is still there, else by a new one from ``start_host``; once per round.
        False when ``port`` is not this round's (nothing started)."""
        with self._lock:
            if port != self._port or self._sock is None:
                return self._current and port == self._port
            sock, self._sock = self._sock, None
            try:
                if self._host is not None and self._host.poll() is None and self._order(SERVE, sock.fileno()):
                    self._current = True
                    return True
                stale = (self._host, self._control)
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one order a message
                try:
                    host = start_host(sock.fileno(), theirs.fileno())
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
            finally:
                sock.close()  # the host has its own copy: the port closes when the host drops it or dies
            self._host, self._control, self._current = host, ours, True
        _kill(*stale)
        threading.Thread(target=self._watch, args=(host,), name="round-store", daemon=True).start()
        return True

    def _order(self, message: bytes, fd: Optional[int] = None) -> bool:
        """Send the host an order (with the lock held); False when it cannot take it (gone)."""
        if self._control is None:
            return False
        try:
            socket.send_fds(self._control, [message], [] if fd is None else [fd])
            return True
        except OSError:
            return False

    def _watch(self, host: Any) -> None:
        code = host.wait()
        line = ""
        if host.stderr is not None:
            try:
                line = host.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
                line = line[0] if line else ""
            except (OSError, ValueError):
                line = ""
            finally:
                host.stderr.close()
        with self._lock:
            ours, current = self._host is host, self._host is host and self._current
            if ours:
                control, self._host, self._control, self._current = self._control, None, None, False
        if ours and control is not None:
            control.close()
        if current:
            self._on_error(line or f"the round's c10d store host exited ({code})")

    def close(self) -> None:
        """Stop serving: kill the host (its sockets close with it), close a socket not yet served."""
        with self._lock:
            self._prepared = self._current = False
            host, control, self._host, self._control = self._host, self._control, None, None
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        _kill(host, control)


def _kill(host: Any, control: Optional[socket.socket] = None) -> None:
    """Kill a store host and reap it, close our end of its control socket (None: nothing to do)."""
    if control is not None:
        control.close()
    if host is None:
        return
    host.kill()
    try:
        host.wait(HOST_WAIT_S)
    except Exception:  # noqa: BLE001 - a host that does not go is left to its parent-death signal
        pass


__all__ = ["LISTEN_BACKLOG", "RoundStore", "StartHost", "listening_socket"]
