"""Host the next round's c10d store without blocking the rendezvous.

The agent binds a fresh store port for every round it may lead (its port goes into the node
record; ``launch/c10d.py``: a socket bound and listening at once, served by torch only in the
rounds the node leads). ``host_store`` runs on a thread all the same: one that blocks (a slow
host) never makes the others wait; the node says it is ready for the round at once (with port
0 while the store starts) and publishes the port when it is up. Only a round whose group rank
0 has a port can be formed.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

# How long next_round waits for the store before it says "ready" without a port: binding a
# port takes milliseconds, so the record is written once.
QUICK_WAIT_S = 0.2


class StoreHost:
    """Runs ``host_store`` (returns a port) on a thread, one call at a time."""

    def __init__(self, host_store: Callable[[], int], on_ready: Callable[[], None]) -> None:
        self._host_store = host_store
        self._on_ready = on_ready
        self._done = threading.Event()
        self._port = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        # Someone asked for the port before the store was up: tell them when it is (a store that was
        # ready at once wakes nobody; agents that share a view, as in the bench, would all wake).
        self._late = False

    def start(self) -> None:
        """Start hosting a fresh store (the previous one is closed by ``host_store``).

        A store still starting is kept: nobody knows its port yet, so it is as fresh as a new one.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        self._done.clear()
        self._port, self._error, self._late = 0, None, False
        self._thread = threading.Thread(target=self._run, name="round-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        port, error = 0, None
        try:
            port = int(self._host_store())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread by port()
            error = err
        with self._lock:
            self._port, self._error = port, error
            self._done.set()
            late = self._late
        if late:
            self._on_ready()

    def port(self, wait: float = 0.0) -> int:
        """The store's port; 0 while it is starting (then ``on_ready`` is called once it is up).
        Raises what ``host_store`` raised."""
        self._done.wait(wait)
        with self._lock:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if self._done.is_set():
                return self._port
            self._late = True
            return 0
