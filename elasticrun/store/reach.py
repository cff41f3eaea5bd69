"""Before talking gRPC: does anything accept a TCP connection at one of the etcd endpoints?

A refused or unroutable connect is known in microseconds, where the etcd client's retries and
gRPC's reconnect backoff take seconds to say the same. :func:`wait_reachable` probes the
endpoints until one accepts (then the client connects at once) or the time is up (then the
caller says why, at its deadline and not later), calling ``on_wait`` while it waits so that
the wait can be told.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Callable, List, Optional, Tuple

from elasticrun.errors import StoreError
from elasticrun.store.explain import START_HINT
from elasticrun.store.types import parse_endpoints
from elasticrun.waiting import Reminder, Say

_REASONS = {errno.ECONNREFUSED: "connection refused", errno.EHOSTUNREACH: "host unreachable",
            errno.ENETUNREACH: "network unreachable", errno.ETIMEDOUT: "connection timed out"}


def describe_connect_error(err: OSError) -> str:
    """A connect error in a few words: ``connection refused``, ``unknown host``, ..."""
    if isinstance(err, socket.gaierror):
        return "unknown host"
    if isinstance(err, (socket.timeout, TimeoutError)):
        return "connection timed out"
    return _REASONS.get(err.errno or 0, err.strerror or err.__class__.__name__)


def probe(hosts: List[Tuple[str, int]], timeout: float = 1.0) -> Optional[str]:
    """None when one of ``hosts`` accepts a TCP connection, else why the last one did not."""
    why = "no endpoint"
    for host, port in hosts:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as err:
            why = describe_connect_error(err)
    return why


def wait_reachable(endpoints: str, timeout: float, on_wait: Optional[Callable[[str], None]] = None,
                   clock: Callable[[], float] = time.monotonic) -> Optional[str]:
    """Probe ``endpoints`` until one accepts a TCP connection, for at most ``timeout`` seconds.

    Returns None as soon as one does; else why not (``connection refused``) once the time is up.
    ``on_wait(why)`` is called after every failed probe. Pauses start at 5 ms (a local etcd that
    is starting is found within milliseconds) and grow to 250 ms.
    """
    hosts = parse_endpoints(endpoints)
    deadline = clock() + timeout
    pause = 0.005
    while True:
        why = probe(hosts, timeout=max(0.05, min(1.0, deadline - clock())))
        if why is None:
            return None
        if on_wait is not None:
            on_wait(why)
        left = deadline - clock()
        if left <= 0:
            return why
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


def wait_for_etcd(endpoints: str, timeout: float, say: Say, why_waiting: str = "", *,
                  what: str = "", hint: str = START_HINT) -> float:
    """Wait until etcd at ``endpoints`` accepts connections, at most ``timeout`` s; return the seconds left.

    When the first probe fails, ``say`` tells at once what is wrong and how long it will be retried
    (``why_waiting`` names the setting, e.g. ``--etcd-timeout``), then every few seconds how long is
    left. At the deadline: StoreError ``cannot reach etcd at ...`` with the reason and ``hint``.
    ``what`` names the etcd in those lines (default ``etcd at <endpoints>``).
    """
    what = what or f"etcd at {endpoints}"
    start = time.monotonic()
    reminder = Reminder(say, f"waiting for {what}", start + timeout)
    told: List[str] = []

    def waiting(why: str) -> None:
        if not told:
            told.append(why)
            setting = f" ({why_waiting})" if why_waiting else ""
            say(f"{what} does not answer ({why}); retrying for up to {timeout:g} s{setting}")
            reminder.restart()
        else:
            reminder.tick()

    why = wait_reachable(endpoints, timeout, waiting)
    if why is not None:
        raise StoreError(f"cannot reach {what} ({why} for {timeout:g} s); {hint}")
    return max(0.0, timeout - (time.monotonic() - start))


__all__ = ["describe_connect_error", "probe", "wait_for_etcd", "wait_reachable"]
