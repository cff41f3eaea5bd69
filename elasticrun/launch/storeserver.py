"""The process that serves one round's c10d store: torch's ``TCPStore`` on a socket the agent bound.

The agent never imports torch. For a round it leads it binds and listens on a fresh port itself
(:mod:`elasticrun.launch.c10d`: the port is known at once, before anyone learns it) and hands the
listening socket to this process, which runs ``TCPStore(..., is_master=True,
master_listen_fd=fd)`` on it. Workers that connect before the store is up wait in the socket's
listen backlog; their TCPStore client retries anyway.

A host serves the later rounds its node leads too, with no new process and no torch import (a
round's re-form does not wait for one): over the control socket the agent sends each new round's
listening socket (``serve`` with the fd attached), and ``retire`` when a round ends, which drops
every store but the newest (the round ending: workers kept through the change still use it). A
dropped store stops listening, so no later round can reach it. The host exits when the agent
closes the control socket, and is killed when another node leads.

Two ways in: forked from the fork server (:func:`serve_store`, called by ``warm.py`` in the child,
torch already imported when the server preloaded it), or ``python -m elasticrun.launch.storeserver
--fd N`` (no fork server: ``--standby 0``, ``--no-python``, a fork-unsafe interpreter). Either way it
dies with its parent (the parent-death signal) and says nothing unless it fails: then one line on
stderr (:data:`ERROR_PREFIX`) and exit 2.

torch ≥ 2.4 serves an inherited socket with its libuv backend; where that backend refuses the fd,
the classic one is tried with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from datetime import timedelta
from typing import Any, List, Optional

SERVE = b"s"  # control message: serve the attached listening socket's store too
RETIRE = b"r"  # control message: drop every store but the newest

ERROR_PREFIX = "elasticrun: cannot host the round's c10d store:"
DEFAULT_TIMEOUT_S = 900.0


def _port_of(fd: int) -> int:
    """The port the listening socket ``fd`` is bound to (the fd itself stays open)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.close()


def host_store(fd: int, timeout_s: float) -> Any:
    """A master ``TCPStore`` serving the listening socket ``fd`` (which it then owns).

    Raises ``RuntimeError`` naming what each backend said when neither takes the socket.
    """
    from torch.distributed import TCPStore

    port = _port_of(fd)
    errors: List[str] = []
    for libuv in (True, False):
        try:
            return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s), master_listen_fd=fd, use_libuv=libuv)
        except (RuntimeError, TypeError, ValueError) as err:
            errors.append(f"{'libuv' if libuv else 'classic'} backend: {str(err).strip().splitlines()[0]}")
            try:
                os.fstat(fd)
            except OSError:
                break  # the first backend closed the socket: nothing left to try
    import torch

    raise RuntimeError(f"torch {torch.__version__} serves no store on an inherited socket "
                       f"({'; '.join(errors)}); torch >= 2.4 does")


def _hosted(fd: int, timeout_s: float) -> Any:
    """:func:`host_store`, or one line on stderr and exit 2."""
    try:
        return host_store(fd, timeout_s)
    except Exception as err:  # noqa: BLE001 - one line for the agent, never a traceback
        sys.stderr.write(f"{ERROR_PREFIX} {err}\n")
        sys.stderr.flush()
        os._exit(2)


def serve_store(fd: int, timeout_s: float = DEFAULT_TIMEOUT_S, control: Optional[int] = None) -> None:
    """Serve the store on ``fd``, then those ``control`` brings (see the module docstring), until the
    control socket closes or this process is killed (without ``control``: killed); on failure one line
    and exit 2. The stores' own threads serve; this one only takes orders."""
    stores = [_hosted(fd, timeout_s)]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if control is None:
        while stores:
            signal.pause()
    with socket.socket(fileno=control) as orders:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(orders, 64, 4)
            except OSError:
                break
            if not message:
                break  # the agent is gone
            if message == RETIRE:
                del stores[:-1]
            stores += [_hosted(new_fd, timeout_s) for new_fd in fds]  # SERVE
    os._exit(0)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m elasticrun.launch.storeserver", description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="the listening socket inherited from the agent")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="the store's timeout, seconds")
    ap.add_argument("--control", type=int, default=None, help="the agent's control socket (later rounds' stores)")
    args = ap.parse_args(argv)
    serve_store(args.fd, args.timeout, args.control)


if __name__ == "__main__":
    main()
