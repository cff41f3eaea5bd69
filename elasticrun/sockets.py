"""The sockets a process group's creation opened, so that its connections can be cut at once.

gloo closes a group's connections only when the last reference to the group goes, and a script's
DDP module holds one until the script rebuilds it. When a peer crashes, the survivors whose
collective waited on the dead peer fail at once (its connections close); a survivor whose
collective waited on *another survivor* would wait for gloo's timeout (30 minutes by default), since
that survivor's connections stay open while it waits in ``InPlace.recover``. Shutting down the
sockets the old round's groups opened (:meth:`OpenedSockets.cut`) makes every peer's pending
collective fail within milliseconds. The memory tier's replica transfers use the same cut on their own
group once it was destroyed under them (:class:`elasticrun.checkpoint.memory.replicas.Replicator`).
Linux (``/proc/self/fd``); elsewhere nothing is recorded.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Dict, Iterator

FD_DIR = "/proc/self/fd"


def socket_fds(fd_dir: str = FD_DIR) -> Dict[int, str]:
    """This process's socket file descriptors: fd → ``socket:[inode]`` (empty where ``fd_dir`` is absent)."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return {}
    found: Dict[int, str] = {}
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor among them)
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


class OpenedSockets:
    """The sockets opened inside :meth:`watch` blocks (a round's group creations), until :meth:`cut`."""

    def __init__(self, fd_dir: str = FD_DIR) -> None:
        self.fd_dir = fd_dir
        self.opened: Dict[int, str] = {}

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record the sockets that the block opens (and that are still open at its end)."""
        before = socket_fds(self.fd_dir)
        try:
            yield
        finally:
            after = socket_fds(self.fd_dir)
            self.opened.update({fd: name for fd, name in after.items() if before.get(fd) != name})

    def cut(self) -> int:
        """Shut down every recorded connection still open under the same inode (a descriptor number reused
        by another socket since is left alone; a listening socket is left alone: gloo's listener thread
        would abort the process); forget them all. How many were shut down."""
        now = socket_fds(self.fd_dir)
        done = 0
        for fd, name in self.opened.items():
            if now.get(fd) != name:
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # gloo's listener: left alone
                    sock.shutdown(socket.SHUT_RDWR)  # the connection ends for the peer too; our fd stays valid
                    done += 1
            except OSError:
                pass  # already closed by its peer
            finally:
                sock.close()  # our duplicate only
        self.opened = {}
        return done


__all__ = ["OpenedSockets", "socket_fds"]
