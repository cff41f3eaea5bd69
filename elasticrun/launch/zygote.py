"""The fork server's side: an interpreter that forks a fresh worker per order, in milliseconds.

The agent starts ``python -m elasticrun.launch.warm --server -- <script> <args>`` with a
``SOCK_SEQPACKET`` Unix socket as its stdin (:mod:`elasticrun.launch.forkserver` is the agent's
side) as its first step, before etcd. The server starts bare: it imports nothing a ``python script.py``
would not have imported before the script's first line, so the first round's workers, forked from it,
start as fast as fresh interpreters (and import torch themselves, as torchrun's do). Once those workers
are past their start-up, the agent orders the preload: the server imports torch and what DDP pulls in on
first use (on a host with few cores the agent orders torch alone at once, before the first round, and
the rest later: :mod:`elasticrun.launch.preload`), checks that it is still single-threaded (``fork()``
copies only the calling thread: a thread pool started by an import would be missing, or hold a lock
forever, in every child) and has not initialized CUDA, and from then on every worker it forks skips
those imports. One message per packet:

    agent → server   {"id": n, "order": {...}} with the worker's stdout and stderr pipe ends
                     attached (SCM_RIGHTS), and any further fds the child needs (listed as the
                     order's ``fds``); the order is warm.py's (env, argv, module, cwd)
                     {"preload": true, "deep": bool}: import torch now (``deep``: and DDP's extras)
    server → agent   {"ready": true} (bare, at start) | {"warm": seconds, "deep": bool} (a preload is done) |
                     {"unsafe": "why"} (at start: then it exits; after the preload: it forks no
                     more, but serves its children's exits until the agent closes it) |
                     {"forked": n, "pid": p} | {"refused": n} | {"exit": p, "code": c}
                     (``Popen.returncode`` style)

Each child starts its own session (the agent signals its process group), dies with the server
(parent-death signal; the server itself dies with the agent), gets the pipes as fds 1 and 2 and
``/dev/null`` as stdin, and returns the order to warm.py, which runs the script as ``__main__``.
The server reaps its children at once (SIGCHLD wakes it), so a dead worker never lingers as a
zombie. End of file on the socket (the agent closed it or died) ends the server.

Keep this module free of elasticrun imports: it runs in the forking interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

MAX_PACKET = 1 << 16  # an order bigger than this goes through a file (warm.py's order_file)
MAX_FDS = 4  # stdout, stderr and what else an order hands its child (the store host's listening socket)
PR_SET_PDEATHSIG = 1
THREAD_EXIT_WAIT_S = 2.0  # how long the server waits for the preload thread's OS thread to be gone


def _threads() -> int:
    """Threads of this process (native ones included: an import may start a BLAS pool)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # not Linux: the agent does not start a fork server there


def _cuda_initialized() -> bool:
    """True when the CUDA driver was initialized here (a forked child could not use CUDA then).

    Asked only when an import already loaded ``libcuda`` (loading it alone is harmless):
    ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED (3) until ``cuInit`` ran.
    """
    try:
        with open("/proc/self/maps") as f:
            if "libcuda.so" not in f.read():
                return False
        import ctypes

        count = ctypes.c_int(0)
        return int(ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count))) != 3
    except (OSError, AttributeError):
        return False


def _fork_unsafe(when: str) -> str:
    """Why forking this interpreter would give broken workers, or ``""`` (``when``: after what)."""
    threads = _threads()
    if threads != 1:
        return f"{threads} threads {when} (fork copies only one)"
    if _cuda_initialized():
        return f"CUDA was initialized {when} (a forked child could not use it)"
    return ""


def _send(sock: socket.socket, message: Dict[str, object]) -> None:
    sock.send(json.dumps(message).encode())


def _parent_death_signal() -> None:
    """SIGKILL this process when its parent (the single-threaded server) exits."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Server:
    def __init__(self, sock: socket.socket, preload: Callable[[bool], None]) -> None:
        self.sock = sock
        self.preload = preload
        self.unsafe = ""  # why this server forks no more (set by a preload that left it unsafe)
        self._preloading: Optional[threading.Thread] = None
        self._preload_done = threading.Event()  # set by the preload thread just before it ends
        self._preload_error = ""
        self._preload_began = 0.0
        self._preload_deep = True  # what the running preload imports
        self._queued: List[Tuple[dict, List[int]]] = []  # orders that came during the preload
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.children: Set[int] = set()
        self.pid = os.getpid()

    def run(self) -> Optional[dict]:
        """Serve until end of file (None); in a forked child, return its order."""
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes the wake-up fd
        signal.set_wakeup_fd(self.wake_w)
        while True:
            ready, _, _ = select.select([self.sock, self.wake_r], [], [])
            if self.wake_r in ready:
                self._drain_wakeups()
            self._reap()
            if self._preloading is not None and self._preload_done.is_set():
                order = self._preloaded()
                if order is not None:
                    return order
            if self.sock in ready:
                try:
                    data, fds, _, _ = socket.recv_fds(self.sock, MAX_PACKET, MAX_FDS)
                except OSError:
                    return None
                if not data:
                    return None  # the agent is gone: our children die with us
                message = json.loads(data)
                if message.get("preload"):
                    self._start_preload(bool(message.get("deep", True)))
                    continue
                if self._preloading is not None:
                    self._queued.append((message, fds))  # no fork while another thread runs
                    continue
                order = self._order(message, fds)
                if order is not None:
                    return order

    def _order(self, message: dict, fds: List[int]) -> Optional[dict]:
        if self.unsafe:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"refused": message["id"]})
            return None
        return self._fork(message, fds)

    def _start_preload(self, deep: bool) -> None:
        """Import torch (``deep``: and DDP's first-use modules) on a thread: meanwhile this thread still
        reaps the children and reports their exits at once. A second preload imports what the first left."""
        if self._preloading is not None or self.unsafe:
            return
        self._preload_began, self._preload_deep = time.monotonic(), deep
        self._preload_done.clear()
        self._preloading = threading.Thread(target=self._run_preload, name="elasticrun-preload", daemon=True)
        self._preloading.start()

    def _run_preload(self) -> None:
        try:
            self.preload(self._preload_deep)
        except BaseException as err:  # noqa: BLE001 - the agent hears of it; the server keeps its children
            self._preload_error = f"the preload failed: {type(err).__name__}: {err}"
        finally:
            self._preload_done.set()
            os.write(self.wake_w, b"p")  # wake the server's loop

    def _preloaded(self) -> Optional[dict]:
        """The preload thread has ended: say whether forking stays safe, then fork what came meanwhile."""
        assert self._preloading is not None
        self._preloading.join()  # it has set the event: it ends now
        self._preloading = None
        deadline = time.monotonic() + THREAD_EXIT_WAIT_S
        while _threads() > 1 and time.monotonic() < deadline:  # its OS thread ends just after join()
            time.sleep(0.005)
        why = self._preload_error or _fork_unsafe("after the preload")
        if why:
            self.unsafe = why
            _send(self.sock, {"unsafe": why})
        else:
            _send(self.sock, {"warm": round(time.monotonic() - self._preload_began, 3), "deep": self._preload_deep})
        queued, self._queued = self._queued, []
        for index, (message, fds) in enumerate(queued):
            order = self._order(message, fds)
            if order is not None:  # in a forked child: the server's other queued orders are not ours
                for _, others in queued[index + 1:]:
                    for fd in others:
                        os.close(fd)
                return order
        return None

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            _send(self.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _fork(self, message: dict, fds: List[int]) -> Optional[dict]:
        """Fork a worker for ``message``; the child returns its order, the server None."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            extra = self._become_child(fds)
            return dict(message["order"], fds=extra)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        _send(self.sock, {"forked": message["id"], "pid": pid})
        return None

    def _become_child(self, fds: List[int]) -> List[int]:
        """In the child: undo the server's plumbing, own session, die with the server, new stdio.
        Returns the fds passed beyond stdout and stderr (inheritable, for the order's use)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.sock.close()
        os.setsid()
        _parent_death_signal()
        if os.getppid() != self.pid:  # the server died before the signal was armed
            os._exit(137)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out, err = (fds + [-1, -1])[:2]
        for target, fd in ((1, out), (2, err)):
            if fd >= 0:
                os.dup2(fd, target)
                os.close(fd)
        extra = fds[2:]
        for fd in extra:
            os.set_inheritable(fd, True)
        _fresh_random_state()
        return extra


def _fresh_random_state() -> None:
    """Give the child its own random state, as a fresh interpreter would have.

    ``random`` reseeds itself after fork; numpy's global generator (seeded from the OS at import,
    in the server) would otherwise be the same in every worker.
    """
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:  # noqa: BLE001 - best effort only
            pass


def serve(preload: Callable[[bool], None]) -> dict:
    """Run the fork server on stdin's socket (``preload``: what the agent's preload order imports);
    returns (in a forked child only) that child's order, with ``fds``: the extra fds it was given."""
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the socket lives on as ``sock``; a forked script must not read it as stdin
    os.close(null)
    why = _fork_unsafe("at start")
    if why:
        _send(sock, {"unsafe": why})
        sys.exit(0)
    _send(sock, {"ready": True})
    order = _Server(sock, preload).run()
    if order is None:
        sys.exit(0)
    return order


__all__ = ["serve"]
