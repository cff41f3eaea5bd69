"""Graceful stop: turn the agent's SIGTERM into a flag the training loop checks.

When the cluster changes, the agent sends SIGTERM to every worker and SIGKILLs them
after a grace period (about 5 s by default). With :class:`GracefulStop` installed, the
first SIGTERM only sets ``requested``; the loop sees it at the next step boundary (agreed
by all ranks, see :class:`~elasticrun.train.control.CheckpointRequests`), saves a
checkpoint and exits 0. A second signal gets the default behaviour (the process dies),
so a stuck worker can still be stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Dict, Optional, Sequence

log = logging.getLogger(__name__)


class GracefulStop:
    """Record stop signals instead of dying on the first one."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self._event = threading.Event()
        self.signal_name: Optional[str] = None
        self.received_at: Optional[float] = None
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (or :meth:`request` was called)."""
        return self._event.is_set()

    def request(self, reason: str = "requested") -> None:
        """Ask for a stop without a signal (e.g. from a watchdog thread or a test)."""
        if not self._event.is_set():
            self.signal_name = reason
            self.received_at = time.monotonic()
            self._event.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until a stop is requested; True if it was."""
        return self._event.wait(timeout)

    def install(self) -> bool:
        """Install the handlers; False (and nothing changed) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("GracefulStop: not in the main thread, signal handlers not installed")
            return False
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set():
            # Second signal: give up on grace and die the way the signal means.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.request(name)
        try:
            sys.stderr.write(f"elasticrun: {name} received, stopping at the next step boundary\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


__all__ = ["GracefulStop"]
