"""The agent's side of the fork server: one interpreter per node that forks every worker.

The agent starts it first, before etcd. It starts bare (:mod:`elasticrun.launch.zygote`): the first
round's workers forked from it are no slower than fresh ``python script.py`` interpreters (they import
torch themselves, as torchrun's workers do), and nothing competes with them for the CPU while they
start. Once they are past their start-up (or while the node waits for a round), the agent orders the
:meth:`ForkServer.preload`: the server imports torch and DDP's first-use modules (~3 CPU-s) once per
agent, not per round or worker, and from then on forks a ready worker in milliseconds at any moment of a
round. On a host with fewer cores than its workers would import torch on at once, ``preload_first`` has
the server import torch alone as it starts and the first round wait for it (one import instead of one
per worker: :mod:`elasticrun.launch.preload`). Its memory is one interpreter's, shared copy-on-write
with the workers forked from it. This module starts it, sends it orders and turns its replies into
:class:`ForkedProcess` objects that look like ``subprocess.Popen`` to the worker group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from enum import Enum
from typing import Dict, List, Optional, Sequence

from elasticrun.proc import with_parent_death_signal

INLINE_MAX = 60_000  # below the server's packet size; a bigger order goes through a file
FORK_TIMEOUT_S = 30.0  # how long a spawn waits for the server's reply before giving up on the server


class ServerState(Enum):
    STARTING = "starting"  # the interpreter starts (bare: no preload)
    READY = "ready"  # forks at once (``warm`` says whether it has preloaded)
    PRELOADING = "preloading"  # importing torch (and DDP's extras): forks once done
    GONE = "gone"  # exited, unsafe to fork from, or closed


class ForkedProcess:
    """A worker forked by the server: the parts of ``subprocess.Popen`` the worker group uses."""

    stdin = None

    def __init__(self, pid: int, stdout: object, stderr: object) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: Optional[int] = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._done.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Start the (bare) server, :meth:`spawn` workers from it, :meth:`preload` it when the CPU is free."""

    def __init__(self, label: List[str], env: Dict[str, str], log_path: str, order_dir: str,
                 preload_first: bool = False) -> None:
        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-u", "-m", "elasticrun.launch.warm", "--server", "--", *label]
        self.log_path = log_path
        self._order_dir = order_dir
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                with_parent_death_signal(cmd), env=env, stdin=theirs.fileno(), stdout=log, stderr=log,
                start_new_session=True,
            )
        theirs.close()
        self.started = time.monotonic()
        self.state = ServerState.STARTING
        self.warm = False  # torch is preloaded: forked workers skip its imports
        self.deep = False  # DDP's first-use modules are preloaded too
        self.preload_first = preload_first  # torch is imported before the first fork (the first round waits)
        self.preload_s: Optional[float] = None  # how long the preload took (the server's clock)
        self.why_gone = ""
        self._cond = threading.Condition()
        self._sending = threading.Lock()  # an order and a preload never interleave on the socket
        self._next_id = 0
        self._pids: Dict[int, int] = {}  # order id → pid
        self._children: Dict[int, ForkedProcess] = {}
        self._early_exits: Dict[int, int] = {}  # pid → code, for an exit read before its ForkedProcess exists
        if preload_first:  # read once the server is up, before any order
            self.state = ServerState.PRELOADING
            try:
                self._ours.send(json.dumps({"preload": True, "deep": False}).encode())
            except OSError as err:
                self._gone(f"sending the preload failed: {err}")
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    # -- replies ------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                data = self._ours.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._cond:
                if "ready" in msg:
                    if self.state is ServerState.STARTING:  # (preload_first: it is preloading already)
                        self.state = ServerState.READY
                elif "warm" in msg:
                    self.warm, self.preload_s = True, float(msg["warm"])
                    self.deep = self.deep or bool(msg.get("deep", True))
                    if self.state is ServerState.PRELOADING:
                        self.state = ServerState.READY
                elif "unsafe" in msg:
                    self._gone(f"not forking: {msg['unsafe']}")
                elif "forked" in msg:
                    self._pids[int(msg["forked"])] = int(msg["pid"])
                elif "refused" in msg:
                    self._gone(self.why_gone or "it refused an order")
                elif "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code
                    else:
                        child._exited(code)
                self._cond.notify_all()
        with self._cond:
            self._gone(self.why_gone or "the fork server exited")
            for child in self._children.values():  # they die with the server (parent-death signal)
                child._exited(-int(signal.SIGKILL))
            self._children.clear()
            self._cond.notify_all()

    def _gone(self, why: str) -> None:
        if self.state is not ServerState.GONE:
            self.state = ServerState.GONE
            self.why_gone = why

    # -- use ----------------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server can fork (True), or is gone / ``timeout`` passed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state not in (ServerState.STARTING, ServerState.PRELOADING), timeout)
            return self.state is ServerState.READY

    def preload(self, deep: bool = True) -> bool:
        """Order the preload of torch and (``deep``) DDP's extras, unless they are preloaded (the server
        imports on a thread, still reporting exits meanwhile). True when it was ordered now; until it is
        done the server forks nothing (``PRELOADING``)."""
        with self._sending:
            with self._cond:
                if self.state is not ServerState.READY or self.deep or (self.warm and not deep):
                    return False
                self.state = ServerState.PRELOADING
            try:
                self._ours.send(json.dumps({"preload": True, "deep": deep}).encode())
            except OSError as err:
                with self._cond:
                    self._gone(f"sending the preload failed: {err}")
                    self._cond.notify_all()
                return False
        return True

    def spawn(self, order: Dict[str, object], timeout: Optional[float] = None,
              fds: Sequence[int] = ()) -> Optional[ForkedProcess]:
        """Fork a child for ``order`` (warm.py's env/argv/module/cwd, or a store host's) that gets
        ``fds`` too (listed as its order's ``fds``); None if the server cannot fork now.

        A server that does not answer within ``timeout`` (default :data:`FORK_TIMEOUT_S`) is closed
        before this returns: it could still fork the order later, a second worker with the same
        RANK next to the one the caller starts instead (closing kills such a late child too).
        """
        timeout = FORK_TIMEOUT_S if timeout is None else timeout
        with self._sending:
            if self.state is not ServerState.READY:
                return None
            return self._spawn(order, timeout, fds)

    def _spawn(self, order: Dict[str, object], timeout: float, fds: Sequence[int]) -> Optional[ForkedProcess]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with self._cond:
            self._next_id += 1
            order_id = self._next_id
        try:
            socket.send_fds(self._ours, [self._packet(order_id, order)], [out_w, err_w, *fds])
        except OSError as err:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            with self._cond:
                self._gone(f"sending an order failed: {err}")
            return None
        os.close(out_w)
        os.close(err_w)
        child = ForkedProcess(-1, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
        with self._cond:
            self._cond.wait_for(lambda: order_id in self._pids or self.state is ServerState.GONE, timeout)
            pid = self._pids.pop(order_id, None)
            if pid is None:
                child.stdout.close()  # type: ignore[attr-defined]
                child.stderr.close()  # type: ignore[attr-defined]
                self._gone(self.why_gone or f"no fork within {timeout:g}s")
        if pid is None:
            self.close()  # no late child (the order may still be in its queue): it dies with the server
            return None
        with self._cond:
            child.pid = pid
            if pid in self._early_exits:
                child._exited(self._early_exits.pop(pid))
            else:
                self._children[pid] = child
        return child

    def _packet(self, order_id: int, order: Dict[str, object]) -> bytes:
        data = json.dumps({"id": order_id, "order": order}).encode()
        if len(data) <= INLINE_MAX:
            return data
        import tempfile

        fd, path = tempfile.mkstemp(prefix="order-", suffix=".json", dir=self._order_dir)  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(order, f)
        return json.dumps({"id": order_id, "order": {"order_file": path}}).encode()

    def close(self) -> None:
        """Stop the server; workers forked from it die with it (idempotent)."""
        try:
            self._ours.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._ours.close()
        with self._cond:
            self._gone("closed")
            self._cond.notify_all()


__all__ = ["ForkServer", "ForkedProcess", "ServerState"]
